"""Smoke-test the DeepGEMM and FlashMLA builds that zerodiff.backends finds on this GPU.

    python build/probe_wheel_kernels.py

Prints one line per check (OK / FAIL with the error) and exits 0 only if every check passed. It runs
tiny shapes only; correctness and invariance live in the gpu test suite.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

import torch  # noqa: E402

from zerodiff import backends  # noqa: E402

failures = 0


def check(name, fn):
    global failures
    try:
        msg = fn()
        print(f"OK   {name}{': ' + msg if msg else ''}", flush=True)
    except Exception as e:  # report and continue
        failures += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=3)


def deepgemm_fp8_gemm():
    dg = backends.deep_gemm()
    if dg is None:
        raise RuntimeError(backends.status()["deepgemm"]["detail"])
    from vllm.third_party.deep_gemm.utils.math import per_block_cast_to_fp8, per_token_cast_to_fp8

    M, N, K = 64, 512, 1024
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    aq = per_token_cast_to_fp8(a, use_ue8m0=False)
    bq = per_block_cast_to_fp8(b, use_ue8m0=False)
    d = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    dg.fp8_gemm_nt(aq, bq, d)
    ref = a.float() @ b.float().T
    rel = ((d.float() - ref).norm() / ref.norm()).item()
    if not rel < 5e-2:
        raise RuntimeError(f"relative error {rel:.3g}")
    return f"M={M} N={N} K={K} rel err {rel:.2e}, num_sms {dg.get_num_sms()}"


def flashmla_sparse():
    fm = backends.flash_mla()
    if fm is None:
        raise RuntimeError(backends.status()["flashmla"]["detail"])
    s_q, h_q, d_qk, s_kv, topk = 4, 64, 576, 256, 128
    q = torch.randn(s_q, h_q, d_qk, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, d_qk, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), device="cuda", dtype=torch.int32)
    out, max_logits, lse = fm.flash_mla_sparse_fwd(q, kv, idx, d_qk**-0.5, 512)
    # float32 reference
    kvs = kv[:, 0].float()[idx[:, 0].long()]  # [s_q, topk, d_qk]
    s = torch.einsum("qhd,qkd->qhk", q.float(), kvs) * d_qk**-0.5
    p = torch.softmax(s, -1)
    ref = torch.einsum("qhk,qkd->qhd", p, kvs[..., :512])
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    if not rel < 2e-2:
        raise RuntimeError(f"relative error {rel:.3g}")
    return f"out {tuple(out.shape)} rel err {rel:.2e}"


def triton_features():
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, h_ptr, c_ptr, B: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, B))
        tl.store(h_ptr + tl.arange(0, 16), tl.histogram(x, 16))
        tl.store(c_ptr + tl.arange(0, B), tl.cumsum(x, 0))

    x = torch.randint(0, 16, (1024,), device="cuda", dtype=torch.int32)
    h = torch.empty(16, device="cuda", dtype=torch.int32)
    c = torch.empty(1024, device="cuda", dtype=torch.int32)
    k[(1,)](x, h, c, B=1024)
    assert torch.equal(h.cpu(), torch.bincount(x.cpu(), minlength=16).int())
    assert torch.equal(c.cpu(), torch.cumsum(x.cpu(), 0).int())
    return f"triton {triton.__version__}: histogram, cumsum"


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    check("triton features", triton_features)
    check("DeepGEMM fp8_gemm_nt", deepgemm_fp8_gemm)
    check("FlashMLA flash_mla_sparse_fwd", flashmla_sparse)
    sys.exit(1 if failures else 0)
