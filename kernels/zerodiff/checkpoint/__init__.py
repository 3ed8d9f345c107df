"""Seeded checkpoints in released-model layouts (``zerodiff make-checkpoint``).

``zerodiff.checkpoint.dsv4``: DeepSeek-V4 in the FP8 base checkpoint's layout, as vLLM 0.33.0 loads it
(see that module for the contract and ``docs/checkpoint.md`` for the names and how they were verified).
``zerodiff.checkpoint.safetensors_io``: the safetensors format, read and written with torch + numpy only.
``zerodiff.checkpoint.cli``: the ``zerodiff make-checkpoint`` subcommand.
"""

from .dsv4 import (  # noqa: F401
    BLOCK,
    DEFAULT_SHARD_BYTES,
    PRESETS,
    SCALE_UE8M0,
    CheckpointError,
    CheckpointPreset,
    MasterSpec,
    Summary,
    checkpoint_layout,
    config_dict,
    dequantize,
    deploy,
    generate_masters,
    make_checkpoint,
    master_layout,
    preset,
    quantize_master,
    read_checkpoint,
    read_masters,
)
