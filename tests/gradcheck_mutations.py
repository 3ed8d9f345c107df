"""Mutation harness for the tight gradient check: plant one bug in the training backward, run the check.

Each :class:`Mutation` edits the SOURCE of one function of the real code (the STE graph functions of
``zerodiff.model.ops.ConsistentOps``, the attention graph, the training forward's gradient accumulation): its
``edits`` are ``(old, new)`` text replacements, each of which must match exactly once (so a refactor of the code
makes the harness fail loudly instead of silently testing nothing). The edited function is compiled in its
module's namespace and swapped in for the duration of the check. Every planted bug is in the backward only:
the harness also checks that the training forward's log-probs keep their bits, i.e. the rollout-vs-training
diff cannot see these bugs and only the gradient check can.

    python tests/gradcheck_mutations.py [--json FILE] [--compare-loose]   # each mutation, worst tensor, err / bound
    python tests/gradcheck_mutations.py --record        # re-measure the unmutated errors (RECORDED_CPU)

``tests/test_gradcheck_tight.py`` asserts that the unmutated backward passes and every mutation fails.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys
import textwrap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mutation:
    name: str
    kind: str  # drop a term | wrong transpose | wrong scale | missing residual grad | off-by-one | sign flip | ...
    what: str
    module: str
    target: str  # "Class.method" or "function"
    edits: tuple  # ((old, new), ...)


_OPS = "zerodiff.model.ops"
MUTATIONS = (
    Mutation("rmsnorm_drop_norm_term", "drop a term", "RMSNorm graph treats 1/rms(x) as a constant",
             _OPS, "ConsistentOps.rms_norm",
             (("r = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)",
               "r = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps).detach()"),)),
    Mutation("silu_drop_derivative_term", "drop a term", "routed experts' SiLU derivative loses its x*s'(x) term",
             _OPS, "ConsistentOps.moe",
             (("y = (_silu(hh[:, :inter]) * hh[:, inter:]) @ W2[e].t()",
               "y = (hh[:, :inter] * torch.sigmoid(hh[:, :inter]).detach() * hh[:, inter:]) @ W2[e].t()"),)),
    Mutation("mhc_final_drop_stream", "drop a term", "final stream sum leaves stream 0 out of the graph",
             _OPS, "ConsistentOps.mhc_final",
             (("lambda: self.graph_of(X).sum(1)", "lambda: self.graph_of(X)[:, 1:].sum(1)"),)),
    Mutation("mhc_post_comb_transposed", "wrong transpose", "mHC post mixes the streams with comb^T",
             _OPS, "ConsistentOps.mhc_post",
             (('torch.einsum("tij,tih->tjh", cg, Xg)', 'torch.einsum("tji,tih->tjh", cg, Xg)'),)),
    Mutation("mhc_pre_comb_logits_transposed", "wrong transpose", "mHC pre's Sinkhorn input logits transposed",
             _OPS, "ConsistentOps.mhc_pre",
             (("lg = mix[:, 2 * n:].reshape(T, n, n) * s[2]",
               "lg = mix[:, 2 * n:].reshape(T, n, n).transpose(1, 2) * s[2]"),)),
    Mutation("fp8_ste_block_scale", "wrong scale in STE", "FP8 linear differentiates through q * scale (the code "
             "treated as the master): gradients scaled by the block scales", _OPS, "ConsistentOps.fp8_linear",
             (("lambda: self.graph_of(x) @ self.master(w).t()",
               "lambda: self.graph_of(x) @ (self.master(w) * w.dep.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)"
               "[: w.dep.q.shape[0], : w.dep.q.shape[1]]).t()"),)),
    Mutation("route_scale_dropped", "wrong scale in STE", "routing graph omits routed_scale",
             _OPS, "ConsistentOps.route",
             (("return sc / sc.sum(-1, keepdim=True) * cfg.routed_scale", "return sc / sc.sum(-1, keepdim=True)"),)),
    Mutation("attention_softmax_scale_dropped", "wrong scale in STE", "attention graph without 1/sqrt(d_qk)",
             _OPS, "_masked_attention_rows",
             (('s = torch.einsum("thd,sd->ths", qg, kv) * sm_scale', 's = torch.einsum("thd,sd->ths", qg, kv)'),)),
    Mutation("mhc_post_missing_residual", "missing residual grad", "no gradient through the residual streams",
             _OPS, "ConsistentOps.mhc_post",
             (('torch.einsum("tij,tih->tjh", cg, Xg)', 'torch.einsum("tij,tih->tjh", cg, Xg).detach()'),)),
    Mutation("routing_grad_next_expert", "off-by-one in routing grad", "routing gradient goes to expert id + 1",
             _OPS, "ConsistentOps.route",
             (("sc = torch.sigmoid(self.graph_of(logits)).gather(1, ids.long())",
               "sc = torch.sigmoid(self.graph_of(logits)).gather(1, (ids.long() + 1) % logits.shape[1])"),)),
    Mutation("routing_grad_next_slot", "off-by-one in routing grad", "expert output weighted by the next slot's "
             "weight in the graph", _OPS, "ConsistentOps.moe",
             (("out = out.index_add(0, tt, wg[tt, jj].unsqueeze(-1) * y)",
               "out = out.index_add(0, tt, wg[tt, (jj + 1) % k].unsqueeze(-1) * y)"),)),
    Mutation("mhc_pre_post_gate_shifted", "off-by-one", "mHC post gates read the mix one column to the right",
             _OPS, "ConsistentOps.mhc_pre",
             (("pg = torch.sigmoid(mix[:, n: 2 * n] * s[1]", "pg = torch.sigmoid(mix[:, n + 1: 2 * n + 1] * s[1]"),)),
    Mutation("sinkhorn_one_iteration_short", "off-by-one", "the graph's Sinkhorn runs one iteration fewer",
             _OPS, "ConsistentOps.mhc_pre",
             (("for _ in range(cfg.sinkhorn_iters - 1):", "for _ in range(cfg.sinkhorn_iters - 2):"),)),
    Mutation("attention_values_shifted", "off-by-one", "attention graph reads values one channel off",
             _OPS, "_masked_attention_rows",
             (('torch.einsum("ths,sd->thd", p, kv[:, :d_v])', 'torch.einsum("ths,sd->thd", p, kv[:, 1: d_v + 1])'),)),
    Mutation("embed_grad_previous_token", "off-by-one", "embedding gradient lands on the previous token's row",
             _OPS, "ConsistentOps.embed", (("lambda: self.master(w)[tokens]", "lambda: self.master(w)[tokens.roll(1)]"),)),
    Mutation("rope_sign_flip", "sign flip", "RoPE graph rotates the wrong way (sin negated)",
             _OPS, "ConsistentOps.rope",
             (("def f(xf):", "def f(xf, s=s):"), ("lambda: f(self.graph_of(x))", "lambda: f(self.graph_of(x), -s)"))),
    Mutation("logsoftmax_sign_flip", "sign flip", "log-prob graph negated", _OPS, "ConsistentOps.logprobs",
             (("return torch.log_softmax(self.graph_of(logits), -1)", "return -torch.log_softmax(self.graph_of(logits), -1)"),)),
    Mutation("shared_expert_gate_up_swapped", "wrong operand", "shared expert's gate and up halves swapped",
             _OPS, "ConsistentOps.moe",
             (("(_silu(hs[:, :shared_inter]) * hs[:, shared_inter:])", "(_silu(hs[:, shared_inter:]) * hs[:, :shared_inter])"),)),
    Mutation("attention_mask_dropped", "packing", "attention graph attends to every token of the packed "
             "micro-batch (other sequences included)", _OPS, "_masked_attention_rows",
             (('s = s.masked_fill(~mask[:, None, :], float("-inf"))', "s = s"),)),
    Mutation("grad_accumulation_dropped", "packing", "each micro-batch's backward overwrites the gradient of the "
             "ones before", "zerodiff.training.forward", "TrainingForward.run",
             (("loss.backward()", "[setattr(p, 'grad', None) for p in self.masters.values()]; loss.backward()"),)),
)


@contextlib.contextmanager
def applied(m: Mutation):
    """The code with ``m`` planted (restored on exit)."""
    mod = importlib.import_module(m.module)
    owner_name, _, attr = m.target.rpartition(".")
    owner = getattr(mod, owner_name) if owner_name else mod
    raw = owner.__dict__[attr]
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in m.edits:
        n = src.count(old)
        if n != 1:
            raise AssertionError(f"mutation {m.name}: {old!r} occurs {n} times in {m.module}.{m.target} (expected 1)")
        src = src.replace(old, new)
    ns: dict = {}
    exec(compile(src, f"<mutation {m.name}>", "exec"), vars(mod), ns)
    new = ns[attr]
    if isinstance(raw, staticmethod):
        new = staticmethod(new)
    setattr(owner, attr, new)
    try:
        yield
    finally:
        setattr(owner, attr, raw)


def worst(errs: dict, bounds: dict) -> tuple:
    """(tensor, err / bound) of the tensor furthest over (or nearest to) its bound."""
    k = max(errs, key=lambda t: errs[t]["rel_err"] / bounds[t])
    return k, errs[k]["rel_err"] / bounds[k]


def run_all(mutations=MUTATIONS, compare_loose: bool = False) -> dict:
    """The unmutated check and every mutation on the recorded recipe; per entry: failed tensors, the worst tensor,
    its err / bound, and whether the forward's log-probs kept their bits. ``compare_loose`` also runs the earlier
    group-level check (unquantised float64 model, one bound of 0.15 per parameter group) on each."""
    from zerodiff.training.gradcheck import (RECORDED_CPU, gradient_check, recorded_recipe, tight_bounds,
                                             tight_gradient_check)

    bounds = tight_bounds(RECORDED_CPU)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run, seqs, coef = recorded_recipe()
        lp0 = run.trainer.run(seqs, pack_seed=0, grad=False)
        out = {}
        for m in (None,) + tuple(mutations):
            with applied(m) if m is not None else contextlib.nullcontext():
                errs = tight_gradient_check(run.trainer, seqs, coef)
                lp = run.trainer.run(seqs, pack_seed=0, grad=False)
                loose = gradient_check(run.trainer, seqs, coef) if compare_loose else None
            over = sorted(t for t in errs if errs[t]["rel_err"] > bounds[t])
            k, ratio = worst(errs, bounds)
            out["(none)" if m is None else m.name] = {
                "kind": "unmutated" if m is None else m.kind, "what": "" if m is None else m.what,
                "tensors_over_bound": over, "worst_tensor": k, "worst_rel_err": errs[k]["rel_err"],
                "worst_err_over_bound": ratio,
                "forward_bits_unchanged": all(torch.equal(lp[k2], lp0[k2]) for k2 in lp0)}
            if loose is not None:
                out["(none)" if m is None else m.name]["loose_max_group_err"] = max(loose.values())
        return out
    finally:
        torch.set_num_threads(old)


def _loose_word(name, err) -> str:
    if name == "(none)":
        return "ok" if err <= 0.15 else "FAILS"
    return "caught" if err > 0.15 else "MISSED"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--record" in argv:
        from zerodiff.training.gradcheck import recorded_recipe, tight_gradient_check

        torch.set_num_threads(1)
        run, seqs, coef = recorded_recipe()
        errs = tight_gradient_check(run.trainer, seqs, coef)
        print("RECORDED_CPU = {")
        for k, v in errs.items():
            print(f'    "{k}": {v["rel_err"]:.3e},  # {v["dtype"]}, rounding floor {v["rounding_floor"]:.2e}')
        print("}")
        return 0
    loose = "--compare-loose" in argv
    res = run_all(compare_loose=loose)
    print(f"{'mutation':36s} {'kind':28s} {'over':>5s} {'worst tensor':26s} {'err/bound':>10s} fwd-bits"
          + ("  loose check (max group err; caught if > 0.15)" if loose else ""))
    for name, r in res.items():
        print(f"{name:36s} {r['kind']:28s} {len(r['tensors_over_bound']):>5d} {r['worst_tensor']:26s} "
              f"{r['worst_err_over_bound']:>10.3g} {'same' if r['forward_bits_unchanged'] else 'CHANGED':8s}"
              + (f"  {r['loose_max_group_err']:.3f} {_loose_word(name, r['loose_max_group_err'])}" if loose else ""))
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(res, f, indent=1)
    ok = not res["(none)"]["tensors_over_bound"] and all(
        r["tensors_over_bound"] and r["forward_bits_unchanged"] for n, r in res.items() if n != "(none)")
    print("PASS: unmutated within every bound, every planted bug caught" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
