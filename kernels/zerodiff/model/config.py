"""Model, rollout and RL configurations for the end-to-end harness, with the ``cpu`` and ``h200`` presets.

``cpu``: every operator class at toy sizes, so ``zerodiff check --config cpu --steps 3`` runs on the
reference backends in well under a minute on one core. ``h200``: realistic per-head shapes (64 query heads,
512 + 64 latent, top-k 2048, contexts of 1.5K-3.6K tokens, 32 experts), 2 layers, sized so 100 RL steps fit
in ~5 minutes on one H200. ``gpu_small``: the GPU tests' smoke preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    hidden: int = 256
    layers: int = 2
    hc_mult: int = 4  # mHC residual streams
    sinkhorn_iters: int = 20
    heads: int = 4
    q_lora: int = 128
    d_latent: int = 128  # kv_lora_rank: the nope latent, FP8 in the cache (multiple of 128)
    d_rope: int = 16  # rotary part, BF16 in the cache (power of two)
    idx_heads: int = 2  # DSA indexer
    idx_dim: int = 32
    topk: int = 16  # DSA Top-K (positions attended per query)
    experts: int = 8
    top_experts: int = 2
    moe_inter: int = 128  # multiple of 128 (FP8 groups of the SiLU*mul output)
    shared_inter: int = 128
    routed_scale: float = 1.5
    rms_eps: float = 1e-6
    max_pos: int = 128  # longest request (prompt + response)
    rope_theta: float = 10000.0
    init_std: float = 0.05

    @property
    def d_qk(self) -> int:
        return self.d_latent + self.d_rope


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = 8
    responses_per_prompt: int = 2
    prompt_len: tuple = (8, 24)  # inclusive range
    response_len: tuple = (8, 16)
    block_size: int = 8  # KV page size (tokens per block)
    num_blocks: int = 256
    token_budget: tuple = (24, 96)  # per engine step, drawn from this range (seeded)
    max_batch: tuple = (3, 12)  # running requests per engine step, drawn from this range
    reward_tokens: int = 64  # reward = fraction of response tokens with id < reward_tokens
    cuda_graphs: bool = True  # pure-decode steps replay captured graphs (CUDA only)
    graph_batch_sizes: tuple = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class TrainConfig:
    micro_tokens: int = 160  # training packs whole sequences into micro-batches of at most this many tokens
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelConfig
    rollout: RolloutConfig
    train: TrainConfig = field(default_factory=TrainConfig)

    def replace(self, **kw) -> "Preset":
        return dataclasses.replace(self, **kw)


CPU = Preset("cpu", ModelConfig(), RolloutConfig())

# H200 acceptance preset: the per-head shapes of DeepSeek-V4-Flash's attention (64 query heads, 512 + 64 latent,
# 128-wide DSA indexer with 64 heads, top-k 2048 over contexts of 1.5K-3.6K tokens), 32 routed experts (top-6) +
# a shared expert, 2 layers. Per RL step 6 requests (3 prompts x 2 responses) x ~2.6K prompt tokens (~16K prefill
# tokens), ~30 decode steps of <= 6 rows in CUDA graphs, a training forward+backward whose STE attention graph is
# dense per micro-batch, one AdamW step over ~0.75B parameters. Measured on the H200 (8 requests per step, warm JIT
# caches; docs/results.md): ~0.7 s rollout + ~3 s training per step; the first run on a machine also compiles
# DeepGEMM's M-dependent kernels (`zerodiff warmup` does that ahead, in parallel).
H200 = Preset(
    "h200",
    ModelConfig(
        vocab=32768, hidden=2048, layers=2, hc_mult=4, heads=64, q_lora=1024, d_latent=512, d_rope=64,
        idx_heads=64, idx_dim=128, topk=2048, experts=32, top_experts=6, moe_inter=1024, shared_inter=1024,
        routed_scale=2.5, max_pos=4096, init_std=0.02,
    ),
    RolloutConfig(
        prompts_per_step=3, responses_per_prompt=2, prompt_len=(1536, 3584), response_len=(16, 48),
        block_size=64, num_blocks=1024, token_budget=(2048, 8192), max_batch=(2, 8),
        reward_tokens=4096, graph_batch_sizes=(1, 2, 4, 8),
    ),
    TrainConfig(micro_tokens=4096, lr=1e-4),
)

# GPU smoke preset (for the gpu-marked tests): the H200 per-head shapes (64 heads - what FlashMLA's FP8 kernels
# take, so the stock baseline runs too - 512 + 64 latent, 128-wide indexer) with few experts and short requests,
# so a whole RL step takes seconds.
GPU_SMALL = Preset(
    "gpu_small",
    ModelConfig(
        vocab=4096, hidden=1024, layers=2, hc_mult=4, heads=64, q_lora=512, d_latent=512, d_rope=64,
        idx_heads=16, idx_dim=128, topk=128, experts=8, top_experts=2, moe_inter=512, shared_inter=512,
        routed_scale=2.5, max_pos=1024, init_std=0.02,
    ),
    RolloutConfig(
        prompts_per_step=8, responses_per_prompt=2, prompt_len=(96, 400), response_len=(16, 48), block_size=64,
        num_blocks=512, token_budget=(256, 1024), max_batch=(4, 16), reward_tokens=512,
        graph_batch_sizes=(1, 2, 4, 8, 16),
    ),
    TrainConfig(micro_tokens=2048, lr=1e-4),
)

PRESETS = {"cpu": CPU, "h200": H200, "gpu_small": GPU_SMALL}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"zerodiff: unknown config {name!r}; choose one of {sorted(PRESETS)}") from None


def default_preset_name() -> str:
    """'h200' when a CUDA device is present, else 'cpu'."""
    import torch

    return "h200" if torch.cuda.is_available() else "cpu"
