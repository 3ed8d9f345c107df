#!/usr/bin/env python3
"""Smoke test of a vLLM runtime on a GPU: a tiny Llama with dummy weights, offline, generating with log-probs.

Run it with the runtime's environment (``. DEST/env.sh``). It writes a 2-layer Llama ``config.json`` into a
temporary folder, starts ``vllm.LLM`` on it (``load_format="dummy"``, no tokenizer, prompt token ids), generates
a few tokens with their log-probs, once eagerly and once with CUDA graphs unless ``--eager-only``, and checks
that ``torch.ops._C.rms_norm`` equals torch's RMSNorm bit for bit. Exit 0 when every step ran.

usage: vllm_runtime_smoke.py [--eager-only] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def rms_norm_check() -> None:
    import torch
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w
    diff = (out.float() - ref.float()).abs().max().item()
    print(f"smoke: torch.ops._C.rms_norm vs torch: max |diff| {diff:g}")


def generate(model: Path, eager: bool, tokens: int) -> None:
    from vllm import LLM, SamplingParams

    t = time.time()
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, enforce_eager=eager,
              gpu_memory_utilization=0.3, max_model_len=256, dtype="bfloat16")
    sp = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, logprobs=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 6]}], sp)
    for o in outs:
        c = o.outputs[0]
        lp = [next(iter(d.values())).logprob for d in c.logprobs]
        print(f"smoke: {'eager' if eager else 'graphs'}: tokens {list(c.token_ids)} log-probs "
              f"{[round(v, 3) for v in lp]}")
    print(f"smoke: {'eager' if eager else 'graphs'} run took {time.time() - t:.1f} s")
    del llm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eager-only", action="store_true", help="skip the CUDA-graph run")
    ap.add_argument("--tokens", type=int, default=8, help="tokens to generate per prompt (default 8)")
    a = ap.parse_args(argv)
    import torch
    import vllm

    print(f"smoke: vllm {vllm.__version__} ({vllm.__file__}), torch {torch.__version__}")
    if not torch.cuda.is_available():
        print("smoke: ERROR: no CUDA device", file=sys.stderr)
        return 1
    rms_norm_check()
    with tempfile.TemporaryDirectory(prefix="zd-tiny-llama-") as d:
        (Path(d) / "config.json").write_text(json.dumps(CONFIG))
        generate(Path(d), eager=True, tokens=a.tokens)
        if not a.eager_only:
            generate(Path(d), eager=False, tokens=a.tokens)
    print("smoke: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
