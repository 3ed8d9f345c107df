"""CPU checks of what runs inside the CUDA-graph decode step, and of the CUDA baseline's wiring.

* ``host_sync_guard`` itself: every pattern it must catch raises when issued from the harness's files, and
  the same code issued from elsewhere does not (negative control).
* The captured decode step of the CUDA branches (``zerodiff.model.ops._cuda`` forced on, zerodiff's ops on
  their CPU references) runs under the guard in "emulate" mode: no host<->device copy, host sync or
  value-dependent shape issued by the harness inside the captured region; emulated graph == eager.
* The frozen CUDA baseline (DeepGEMM / FlashMLA calls) runs on CPU against FAKE DeepGEMM / FlashMLA modules
  that check the documented call signatures and compute the same math with the references: catches
  shape / argument mistakes of the GPU-only path without a GPU. Values are not the real kernels'.
"""

from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

from e2e_helpers import assert_graph_equals_eager, graph_and_eager, make_requests
from zerodiff.model.config import CPU
from zerodiff.model.ops import make_ops
from zerodiff.model.weights import Deployment, init_masters
from zerodiff.rollout.engine import RolloutEngine
from zerodiff.rollout.graphs import GUARD_ROOTS, HostSyncError, host_sync_guard


pytestmark = pytest.mark.usefixtures("one_thread")


def _run_as(filename, src, env):
    exec(compile(src, filename, "exec"), env)


BAD = {
    "item": "x[0].item()",
    "tolist": "x.tolist()",
    "cpu": "x.cpu()",
    "bool": "bool(x.sum())",
    "if": "if x.sum():\n    pass",
    "int": "int(x.sum())",
    "float": "float(x.sum())",
    "nonzero": "x.nonzero()",
    "torch.nonzero": "torch.nonzero(x)",
    "unique": "torch.unique(x)",
    "tensor": "torch.tensor([1, 2])",
    "as_tensor": "torch.as_tensor([1, 2])",
    "mask index": "x[x > 1]",
    "mask assign": "x[x > 1] = 0",
    "repeat_interleave": "torch.repeat_interleave(x, x.long().clamp(min=0))",
    "to other device": "x.to('meta')",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_guard_catches_each_pattern_and_only_in_harness_files(name):
    env = {"torch": torch, "x": torch.arange(4, dtype=torch.float32)}
    ours = os.path.join(GUARD_ROOTS[0], "_fake_captured.py")
    with host_sync_guard():
        with pytest.raises(HostSyncError, match="captured decode step"):
            _run_as(ours, BAD[name], dict(env))
        _run_as("/elsewhere/not_ours.py", BAD[name], dict(env))  # negative control: not inspected
    _run_as(ours, BAD[name], dict(env))  # outside the guard: allowed
    # allowed inside the guard: pure device ops with static shapes
    with host_sync_guard():
        _run_as(ours, "y = x[1:3] * 2\nz = torch.where(x > 1, x, torch.zeros_like(x))\nw = x.to(torch.float64)\n"
                      "v = x.repeat_interleave(2)\nu = x[torch.tensor_split(x, 2)[0].long()]", dict(env))


# ---- fakes of DeepGEMM / FlashMLA (documented signatures, reference math) --------------------------------
def _fake_deepgemm():
    from zerodiff.reference.fp8_gemm import fp8_gemm_ref

    calls = {"fp8_gemm_nt": 0, "contiguous": 0, "masked": 0}
    state = {"align": 256, "cap": []}  # a non-default BLOCK_M alignment: the buffer must follow it

    def get_mk_alignment_for_contiguous_layout():
        return state["align"]

    def set_mk_alignment_for_contiguous_layout(v):
        state["cap"].append(v)
        state["align"] = v

    def _chk(a, w):
        (aq, as_), (wq, ws) = a, w
        assert aq.dtype == torch.float8_e4m3fn and as_.dtype == torch.float32 and wq.dtype == torch.float8_e4m3fn
        return aq, as_, wq, ws

    def fp8_gemm_nt(a, w, out, disable_ue8m0_cast=False):
        aq, as_, wq, ws = _chk(a, w)
        assert aq.dim() == 2 and wq.dim() == 2 and out.shape == (aq.shape[0], wq.shape[0])
        assert as_.shape == (aq.shape[0], (aq.shape[1] + 127) // 128)
        calls["fp8_gemm_nt"] += 1
        out.copy_(fp8_gemm_ref(aq, as_, wq, ws))

    def m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_indices, disable_ue8m0_cast=False):
        aq, as_, wq, ws = _chk(a, w)
        assert wq.dim() == 3 and m_indices.dtype == torch.int32 and m_indices.shape == (aq.shape[0],)
        al = state["align"]
        assert aq.shape[0] % al == 0 and out.shape == (aq.shape[0], wq.shape[1])
        # every BLOCK_M (= alignment) tile belongs to one expert (or is padding): what the kernel's scheduler reads
        tiles = m_indices.view(-1, al)
        valid = tiles >= 0
        first = tiles[:, :1].expand_as(tiles)
        assert bool(((tiles == first) | ~valid).all()) and bool((~valid[:, :1] <= ~valid).all())
        calls["contiguous"] += 1
        for e in range(wq.shape[0]):
            rows = (m_indices == e).nonzero().flatten()
            if rows.numel():
                out[rows] = fp8_gemm_ref(aq[rows], as_[rows], wq[e], ws[e])

    def m_grouped_fp8_gemm_nt_masked(a, w, out, masked_m, expected_m, disable_ue8m0_cast=False):
        aq, as_, wq, ws = _chk(a, w)
        E = wq.shape[0]
        assert aq.dim() == 3 and aq.shape[0] == E and out.shape == (E, aq.shape[1], wq.shape[1])
        assert masked_m.shape == (E,) and masked_m.dtype == torch.int32 and isinstance(expected_m, int)
        calls["masked"] += 1
        for e in range(E):
            n = int(masked_m[e])
            assert n <= aq.shape[1]
            if n:
                out[e, :n] = fp8_gemm_ref(aq[e, :n], as_[e, :n], wq[e], ws[e])

    return types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt, m_grouped_fp8_gemm_nt_contiguous=m_grouped_fp8_gemm_nt_contiguous,
                                 m_grouped_fp8_gemm_nt_masked=m_grouped_fp8_gemm_nt_masked, calls=calls, state=state,
                                 get_mk_alignment_for_contiguous_layout=get_mk_alignment_for_contiguous_layout,
                                 set_mk_alignment_for_contiguous_layout=set_mk_alignment_for_contiguous_layout)


def _fake_flashmla(cfg):
    from zerodiff.model.baseline_cuda import dequant_tokens
    from zerodiff.reference.sparse_attention import sparse_attention_ref

    calls = {"decode": 0, "sparse_fwd": 0}

    class Meta:
        pass

    def get_mla_metadata(*a, **k):
        return Meta(), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits=None,
                               softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, **kw):
        assert isinstance(meta, Meta) and block_table is None and cache_seqlens is None and is_fp8_kvcache
        B, sq, h, d = q.shape
        assert sq == 1 and q.dtype == torch.bfloat16 and k_cache.dim() == 4 and k_cache.shape[2] == 1
        assert indices.dtype == torch.int32 and indices.shape[:2] == (B, 1) and head_dim_v == cfg.d_latent
        calls["decode"] += 1
        nb, bs = k_cache.shape[:2]
        kv = dequant_tokens(k_cache[:, :, 0], torch.arange(nb * bs), cfg.d_latent, cfg.d_rope)
        o, lse = sparse_attention_ref(q[:, 0], kv, indices[:, 0], softmax_scale, head_dim_v)
        return o[:, None], lse

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None):
        assert q.dim() == 3 and kv.dim() == 3 and kv.shape[1] == 1 and indices.dim() == 3 and indices.shape[1] == 1
        assert indices.dtype == torch.int32 and indices.shape[0] == q.shape[0] and kv.dtype == torch.bfloat16
        calls["sparse_fwd"] += 1
        o, lse = sparse_attention_ref(q, kv[:, 0], indices[:, 0], sm_scale, d_v)
        return o, lse, lse

    return types.SimpleNamespace(get_mla_metadata=get_mla_metadata, flash_mla_with_kvcache=flash_mla_with_kvcache,
                                 flash_mla_sparse_fwd=flash_mla_sparse_fwd, calls=calls)


@pytest.fixture
def cuda_branches(monkeypatch):
    """Force the harness's CUDA branches on CPU tensors (zerodiff ops on their references; fake DeepGEMM/FlashMLA)."""
    import zerodiff._triton as zt
    import zerodiff.backends as zb
    import zerodiff.model.baseline_cuda as bc
    import zerodiff.model.cache as zc
    import zerodiff.model.ops as zo
    from zerodiff.ops.indexer import new_index_cache

    monkeypatch.setattr(zo, "_cuda", lambda t: True)
    monkeypatch.setattr(zt, "INTERPRET", False)
    orig = zc.PagedCache.__init__

    def init(self, cfg, nb, bs, device="cpu"):
        orig(self, cfg, nb, bs, device)
        self.idx_cache = [new_index_cache(nb, bs, d=cfg.idx_dim, device=device) for _ in range(cfg.layers)]

    monkeypatch.setattr(zc.PagedCache, "__init__", init)
    dg, fm = _fake_deepgemm(), _fake_flashmla(CPU.model)
    monkeypatch.setattr(zb, "deep_gemm", lambda: dg)
    monkeypatch.setattr(zb, "flash_mla", lambda: fm)
    monkeypatch.setattr(bc, "FLASHMLA_HEADS", (CPU.model.heads,))
    monkeypatch.setattr(bc, "FLASHMLA_DQK", CPU.model.d_qk)
    monkeypatch.setattr(bc, "CHOICES", {})
    monkeypatch.setattr(bc, "_FALLBACK", {})
    return types.SimpleNamespace(dg=dg, fm=fm, bc=bc)


def _requests(seed, n, vocab, plen=(8, 24), rlen=(4, 10)):
    return make_requests(seed, n, vocab, plen, rlen, first_rid=2000)


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_emulated_captured_decode_step_has_no_host_sync(cuda_branches, mode):
    cfg = CPU.model
    masters = init_masters(cfg, 3)
    reqs = _requests(5, 6, cfg.vocab)
    # guard: any host<->device traffic / sync from the harness raises HostSyncError
    res, eng = graph_and_eager(CPU, masters, mode, reqs, 6, sample_seed=4, guard=True)
    assert eng.stats["graph_steps"] > 0 and eng.graphs.disabled is None
    if mode == "consistent":  # graph == eager (masked MoE layout in the graph, contiguous eager)
        assert_graph_equals_eager(res, reqs)
    else:  # the baseline's CUDA wiring really ran (fakes), in both layouts and both attention kernels
        c = cuda_branches
        assert c.dg.calls["fp8_gemm_nt"] > 0 and c.dg.calls["masked"] > 0 and c.dg.calls["contiguous"] > 0
        assert c.fm.calls["decode"] > 0 and c.fm.calls["sparse_fwd"] > 0
        assert not any("rejected" in v for v in c.bc.CHOICES.values()), c.bc.CHOICES
        assert c.dg.state["align"] == 256 and 256 in c.dg.state["cap"]  # BLOCK_M capped at the buffer's, restored


def test_guard_would_catch_a_sync_in_the_decode_step(cuda_branches, monkeypatch):
    """Negative control of the emulation: a host sync planted in the harness's decode step is reported."""
    import zerodiff.model.ops as zo

    orig = zo.ConsistentOps.kernel_moe_visible
    src = "def planted(self, x, *a):\n    if x.abs().sum():\n        pass\n    return orig(self, x, *a)\n"
    env = {"orig": orig}
    _run_as(os.path.join(GUARD_ROOTS[0], "_planted.py"), src, env)
    monkeypatch.setattr(zo.ConsistentOps, "kernel_moe_visible", env["planted"])
    cfg = CPU.model
    eng = RolloutEngine(CPU, Deployment(init_masters(cfg, 3)), make_ops("consistent", "rollout", cfg), sample_seed=4,
                        use_graphs="emulate")
    eng.graphs.guard = True
    with pytest.raises(HostSyncError, match="_planted.py"):
        eng.generate(_requests(5, 3, cfg.vocab), 6)


def test_baseline_cuda_wiring_rl_step_runs_on_both_sides(cuda_branches):
    """One RL step of the baseline through the CUDA wiring (fakes), the same stock ops on both sides: runs end to
    end (training forward and backward included), and on equal inputs the two sides agree bit for bit. The fakes
    are exact row-invariant references, so no diff is asserted here: on the GPU it comes from the real kernels."""
    from zerodiff.rl.control import control_probe
    from zerodiff.rl.loop import RLRun

    p = CPU.replace(rollout=dataclasses.replace(CPU.rollout, prompts_per_step=2))
    run = RLRun(p, 0, "baseline")
    rep = run.run_step()
    c = cuda_branches
    assert rep["tokens"] > 0 and run.step == 1
    assert c.dg.calls["fp8_gemm_nt"] > 0 and c.fm.calls["decode"] > 0 and c.fm.calls["sparse_fwd"] > 0
    probe = control_probe(run)
    assert probe["same_inputs"]["equal"] and probe["train_ops"] == probe["rollout_ops"] == "BaselineRolloutOps"


def test_cuda_wiring_at_the_flashmla_per_head_shapes(cuda_branches, monkeypatch):
    """The same emulation at the real per-head shapes (64 heads, 512 + 64 latent: the 656-byte FP8 cache with 4
    scale groups, FlashMLA's head check not relaxed), one layer and tiny widths elsewhere: consistent graph ==
    eager under the guard, and the baseline's CUDA wiring runs in both graph and eager steps."""
    from zerodiff.model.config import ModelConfig

    bc = cuda_branches.bc
    monkeypatch.setattr(bc, "FLASHMLA_HEADS", (64, 128))
    monkeypatch.setattr(bc, "FLASHMLA_DQK", 576)
    mc = ModelConfig(vocab=512, hidden=256, layers=1, heads=64, q_lora=128, d_latent=512, d_rope=64, idx_heads=2,
                     idx_dim=128, topk=64, experts=4, top_experts=2, moe_inter=128, shared_inter=128, max_pos=128)
    fm = _fake_flashmla(mc)
    import zerodiff.backends as zb

    monkeypatch.setattr(zb, "flash_mla", lambda: fm)
    p = CPU.replace(model=mc)
    masters = init_masters(mc, 3)
    reqs = _requests(5, 4, mc.vocab, plen=(8, 20), rlen=(3, 6))
    for mode in ("consistent", "baseline"):
        res, eng = graph_and_eager(p, masters, mode, reqs, 6, sample_seed=4, guard=True)
        assert eng.stats["graph_steps"] > 0 and eng.graphs.disabled is None
        if mode == "consistent":
            assert_graph_equals_eager(res, reqs, responses=False)
    assert fm.calls["decode"] > 0 and fm.calls["sparse_fwd"] > 0
    assert not any("rejected" in v for v in bc.CHOICES.values()), bc.CHOICES
