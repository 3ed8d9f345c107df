"""Stock-style mHC pre: the batch-dependent split vLLM uses, and a plain torch eager path.

* :func:`mhc_pre_split_baseline`: the projection split into ``n_splits`` partials with the split count from
  the token count and the SM count as vLLM 0.33.0 computes it (:func:`stock_num_splits`), the partials added
  in split order, then the epilogue. Its bits depend on T: NOT batch-invariant, by design (the negative
  control of ``zerodiff.ops.mhc`` and the baseline model's mHC pre).
* :func:`pre_epilogue`: the Triton epilogue over S partials added sequentially in split order (a stand-in for
  TileLang's fused epilogue with the same memory traffic); with S fixed it is per-row and exact in order.
* :func:`mhc_pre_torch_eager`: fp32 torch eager mHC pre (vLLM's ``forward_native`` style), a benchmark
  reference point and the training-side stock path of the baseline model.

Shapes and dtypes are those of ``zerodiff.ops.mhc.mhc_pre``; bad input raises the same ``ValueError``s, plus
an unknown ``gemm`` / ``epilogue`` name.
"""

from __future__ import annotations

import torch

from zerodiff import _triton as zt
from zerodiff.ops import mhc as _mhc
from zerodiff.reference import mhc as ref

if zt.HAVE_TRITON:
    import triton
    import triton.language as tl

    from zerodiff.ops.mhc import _finish_pre_row

__all__ = ["stock_num_splits", "pre_epilogue", "mhc_pre_split_baseline", "mhc_pre_torch_eager"]

_EPI_BLOCK_H = 1024
_EPI_WARPS = 4

# ----------------------------------------------------------------------------------------- kernels

if zt.HAVE_TRITON:

    @triton.jit(do_not_specialize=["T"])  # one binary for every token count (T == 1 included)
    def _mhc_pre_epilogue_kernel(
        mix_ptr, sq_ptr, scale_ptr, base_ptr, res_ptr, li_ptr, post_ptr, comb_ptr,
        T, H, K, rms_eps, pre_eps, sk_eps, post_mult, ITERS,
        S, NH: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        NMIX: tl.constexpr = NH * (NH + 2)
        n = tl.arange(0, NH)
        ii = tl.arange(0, NH)[:, None]
        jj = tl.arange(0, NH)[None, :]
        mrow = mix_ptr + row * NMIX
        # partial sums added in split order
        sq = tl.load(sq_ptr + row)
        pre_r = tl.load(mrow + n)
        post_r = tl.load(mrow + NH + n)
        comb_r = tl.load(mrow + 2 * NH + ii * NH + jj)
        t64 = tl.zeros([], dtype=tl.int64) + T  # int64 split strides
        for s in range(1, S):  # runtime loop: one compiled kernel for every split count
            ms = mrow + s * t64 * NMIX
            sq = sq + tl.load(sq_ptr + s * t64 + row)
            pre_r = pre_r + tl.load(ms + n)
            post_r = post_r + tl.load(ms + NH + n)
            comb_r = comb_r + tl.load(ms + 2 * NH + ii * NH + jj)
        _finish_pre_row(sq, pre_r, post_r, comb_r, row, K, scale_ptr, base_ptr, res_ptr, li_ptr, post_ptr, comb_ptr,
                        H, rms_eps, pre_eps, sk_eps, post_mult, ITERS, NH, BLOCK_H, EXACT)


# --------------------------------------------------------------------------------------- launchers


def pre_epilogue(mix: torch.Tensor, sq: torch.Tensor, residual: torch.Tensor, hc_scale: torch.Tensor,
                 hc_base: torch.Tensor, *, rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
                 hc_post_mult: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton epilogue: partials mix fp32 [S, T, n_mix] / sq fp32 [S, T], added in split order -> gates,
    Sinkhorn, aggregation (the triple of ``zerodiff.ops.mhc.mhc_pre``)."""
    S, T, nm = mix.shape
    _, n, H = residual.shape
    li, post, comb = _mhc.pre_outputs(residual)
    if T == 0:
        return li, post, comb
    _mhc_pre_epilogue_kernel[(T,)](
        mix.contiguous(), sq.contiguous(), hc_scale.contiguous(), hc_base.contiguous(),
        residual.contiguous(), li, post, comb, T, H, n * H,
        float(rms_eps), float(hc_pre_eps), float(hc_sinkhorn_eps), float(hc_post_mult), int(sinkhorn_iters),
        S, NH=n, BLOCK_H=_EPI_BLOCK_H, EXACT=zt.EXACT_CASTS, num_warps=_EPI_WARPS, **zt.LAUNCH_OPTS,
    )
    return li, post, comb


def stock_num_splits(num_tokens: int, k: int, n_sms: int, block_k: int = 64) -> int:
    """vLLM 0.33.0's split count for the mHC pre-norm GEMM (our restatement of ``compute_num_split``
    with ``grid = ceil(T / 64)``): ``max(1, min(n_sms // grid, ceil(k / block_k) // 4))``."""
    grid = max(1, -(-num_tokens // 64))
    return max(1, min(n_sms // grid, (-(-k // block_k)) // 4))


def _default_sms(device) -> int:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H200


def _split_gemm_torch(x: torch.Tensor, fn: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partials kept apart. On the CPU each partial is computed in float64 and rounded once to
    fp32 (so a partial does not depend on the batch: the split count is the only batch dependence left,
    which is what the negative control isolates); on CUDA it is a plain fp32 cuBLAS matmul per split."""
    T, K = x.shape
    acc_dtype = torch.float32 if x.is_cuda else torch.float64
    chunk = -(-(-(-K // 64)) // splits) * 64
    mix = torch.zeros(splits, T, fn.shape[0], dtype=torch.float32, device=x.device)
    sq = torch.zeros(splits, T, dtype=torch.float32, device=x.device)
    for s in range(splits):
        k0, k1 = s * chunk, min((s + 1) * chunk, K)
        if k0 >= k1:
            continue
        xs = x[:, k0:k1].to(acc_dtype)
        mix[s] = (xs @ fn[:, k0:k1].to(acc_dtype).t()).float()
        sq[s] = (xs * xs).sum(-1).float()
    return mix, sq


def _epilogue_torch(mix, sq, residual, hc_scale, hc_base, *, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                    hc_post_mult, sinkhorn_iters):
    """fp32 eager epilogue (partials added in split order), stock torch-style."""
    T, n, H = residual.shape
    m = mix[0].clone()
    s = sq[0].clone()
    for i in range(1, mix.shape[0]):
        m = m + mix[i]
        s = s + sq[i]
    m = m * torch.rsqrt(s / (n * H) + rms_eps).unsqueeze(-1)
    pre = torch.sigmoid(m[:, :n] * hc_scale[0] + hc_base[:n]) + hc_pre_eps
    post = torch.sigmoid(m[:, n : 2 * n] * hc_scale[1] + hc_base[n : 2 * n]) * hc_post_mult
    logits = m[:, 2 * n :].reshape(T, n, n) * hc_scale[2] + hc_base[2 * n :].reshape(1, n, n)
    comb = ref.sinkhorn_ref(logits, sinkhorn_iters, hc_sinkhorn_eps)
    li = (pre.unsqueeze(-1) * residual.float()).sum(dim=1).to(torch.bfloat16)
    return li, post.contiguous(), comb.contiguous()


# ------------------------------------------------------------------------------------ public ops


def mhc_pre_split_baseline(
    residual: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float = ref.RMS_EPS,
    hc_pre_eps: float = ref.HC_EPS,
    hc_sinkhorn_eps: float = ref.HC_EPS,
    hc_post_mult: float = ref.POST_MULT,
    sinkhorn_iters: int = ref.SINKHORN_ITERS,
    n_splits: int | None = None,
    n_sms: int | None = None,
    gemm: str = "auto",
    epilogue: str = "auto",
    info: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stock-style mHC pre whose bits depend on the batch: NOT batch-invariant, by design.

    ``n_splits`` defaults to :func:`stock_num_splits` of (T, n*H, SM count) as vLLM computes it. ``gemm``:
    "deepgemm" (DeepGEMM's ``tf32_hc_prenorm_gemm``, vLLM's CUDA path), "torch" (per-split fp32 matmuls,
    partials kept apart), or "auto" (DeepGEMM when importable on a CUDA tensor, else torch). The partials
    are added in split order by ``epilogue`` "triton" (:func:`pre_epilogue`) or "torch" (fp32 eager),
    "auto" = triton where it can run. With "auto", a DeepGEMM call that raises falls back to torch.
    ``info`` (optional dict) receives what ran: ``gemm``, ``n_splits``, ``epilogue``, ``deepgemm_error``.
    Returns the same triple as ``zerodiff.ops.mhc.mhc_pre``."""
    _mhc._check_pre(residual, fn, hc_scale, hc_base, sinkhorn_iters)
    T, n, H = residual.shape
    K = n * H
    if n_splits is None:
        n_splits = stock_num_splits(T, K, n_sms or _default_sms(residual.device))
    x = residual.contiguous().view(T, K)
    use_dg = False
    if gemm in ("auto", "deepgemm") and residual.is_cuda:
        from zerodiff import backends

        dg = backends.deep_gemm()
        use_dg = dg is not None and hasattr(dg, "tf32_hc_prenorm_gemm")
        if gemm == "deepgemm" and not use_dg:
            raise _mhc._err("gemm='deepgemm' requested but DeepGEMM's tf32_hc_prenorm_gemm is not importable")
    elif gemm not in ("auto", "torch", "deepgemm"):
        raise _mhc._err(f"unknown gemm {gemm!r}")
    info = {} if info is None else info
    info["n_splits"] = n_splits
    if use_dg:
        mix = torch.empty(n_splits, T, ref.n_mix(n), dtype=torch.float32, device=residual.device)
        sq = torch.empty(n_splits, T, dtype=torch.float32, device=residual.device)
        try:
            dg.tf32_hc_prenorm_gemm(x, fn.contiguous(), mix, sq, n_splits)
            info["gemm"] = "deepgemm.tf32_hc_prenorm_gemm"
        except Exception as e:  # noqa: BLE001 - baseline only; recorded for the benchmark
            if gemm == "deepgemm":
                raise
            info["deepgemm_error"] = f"{type(e).__name__}: {e}"
            use_dg = False
    if not use_dg:
        mix, sq = _split_gemm_torch(x, fn, n_splits)
        info["gemm"] = "torch per-split matmul"
    kw = dict(rms_eps=rms_eps, hc_pre_eps=hc_pre_eps, hc_sinkhorn_eps=hc_sinkhorn_eps,
              hc_post_mult=hc_post_mult, sinkhorn_iters=sinkhorn_iters)
    if epilogue == "auto":
        epilogue = "triton" if zt.triton_usable_for(residual.device) else "torch"
    info["epilogue"] = epilogue
    if epilogue == "triton":
        return pre_epilogue(mix, sq, residual, hc_scale, hc_base, **kw)
    if epilogue != "torch":
        raise _mhc._err(f"unknown epilogue {epilogue!r}")
    return _epilogue_torch(mix, sq, residual, hc_scale, hc_base, **kw)


def mhc_pre_torch_eager(residual, fn, hc_scale, hc_base, *, rms_eps=ref.RMS_EPS, hc_pre_eps=ref.HC_EPS,
                        hc_sinkhorn_eps=ref.HC_EPS, hc_post_mult=ref.POST_MULT,
                        sinkhorn_iters=ref.SINKHORN_ITERS):
    """Plain fp32 torch eager mHC pre (vLLM's ``forward_native`` style): a benchmark reference point."""
    return ref.mhc_pre_ref(residual, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps,
                           hc_sinkhorn_eps=hc_sinkhorn_eps, hc_post_mult=hc_post_mult,
                           sinkhorn_iters=sinkhorn_iters, dtype=torch.float32)
