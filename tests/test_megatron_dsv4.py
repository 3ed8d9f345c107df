"""CPU tests of the DeepSeek-V4 actor in megatron-core (``zerodiff.integrations.megatron.dsv4``): the weight
mapping, the refit format and its in-place write, the refusals, construction through a model provider,
bit-exact checkpoint loads, log-probs equal to the zerodiff rollout engine's through Megatron-RL's and the
cross-entropy path, the stale-weight defect under megatron-core's optimizer, gradients, save/restore, and a
short ``zerodiff megatron-check``.

Tests taking the ``megatron`` fixture import megatron-core from ``build/sources/megatron`` (``make sources``)
and are skipped where it is absent (CI does not fetch it); the others need no megatron.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace as NS

import pytest
import torch

from bitwise import assert_bitwise_equal
from zerodiff.checkpoint.dsv4 import config_dict, preset as ckpt_preset
from zerodiff.integrations import ConfigError
from zerodiff.integrations.megatron.dsv4 import config as dcfg
from zerodiff.integrations.megatron.dsv4 import guard as dguard
from zerodiff.integrations.megatron.dsv4 import weights as dw
from zerodiff.model.config import CPU
from zerodiff.model.ops import make_ops
from zerodiff.model.weights import Deployment, init_masters, param_shapes
from zerodiff.ops.fp8_quant import Fp8Weight
from zerodiff.rollout.engine import Request, RolloutEngine
from zerodiff.training.forward import TrainingForward

CFG = CPU.model


@pytest.fixture
def parallel_state(megatron, tmp_path_factory):
    from zerodiff.integrations.megatron.dsv4.acceptance import init_parallel_state

    init_parallel_state("cpu", tmp_path_factory.mktemp("pg"))
    from megatron.core import parallel_state as ps

    return ps


@pytest.fixture(scope="module")
def masters():
    return init_masters(CFG, 0)


def _actor(masters):
    from zerodiff.integrations.megatron.dsv4 import build_model

    m = build_model(CFG)
    m.load_masters({k: v.detach() for k, v in masters.items()})
    return m


def _rollout(masters, n=6, seed=0, conc=(3, 12), sample_seed=1):
    eng = RolloutEngine(CPU.replace(rollout=CPU.rollout.__class__(**{**CPU.rollout.__dict__, "max_batch": conc})),
                        Deployment({k: v.detach() for k, v in masters.items()}),
                        make_ops("consistent", "rollout", CFG), sample_seed=sample_seed)
    rng = random.Random(seed)
    reqs = [Request(i, [rng.randrange(CFG.vocab) for _ in range(rng.randint(8, 24))], rng.randint(8, 16))
            for i in range(n)]
    return eng.generate(reqs, sched_seed=seed + 3)


# ------------------------------------------------------------------------------------ mapping (no megatron)
def test_mapping_names_every_master_once_and_round_trips_bit_exact(masters):
    rows = dw.mapping(CFG)
    assert [r[0] for r in rows] == list(param_shapes(CFG))
    mods = [r[1] for r in rows]
    cks = [c for r in rows for c in r[2]]
    assert len(set(mods)) == len(mods) and len(set(cks)) == len(cks)
    assert dw.module_name("layers.1.exp_w13") == "decoder.layers.1.mlp.experts.weight1"
    assert dw.checkpoint_parts("layers.0.exp_w13", CFG)[:2] == [
        ("layers.0.ffn.experts.0.w1.weight", (0, slice(0, CFG.moe_inter))),
        ("layers.0.ffn.experts.0.w3.weight", (0, slice(CFG.moe_inter, 2 * CFG.moe_inter)))]
    back = dw.masters_from_checkpoint({k: v.clone() for k, v in dw.masters_as_checkpoint(masters, CFG).items()}, CFG)
    for k, m in masters.items():
        assert_bitwise_equal(back[k], m.detach(), k)


def test_refit_writes_the_exported_checkpoint_tensors_in_place(seeded, masters):
    rollout = Deployment({k: v.detach() for k, v in masters.items()})
    g = seeded()
    new = {k: (v.detach().float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in masters.items()}
    trained = Deployment(new)
    exported = dw.export_deployment(trained, CFG)
    # the export format is the checkpoint's: <x>.weight e4m3 + <x>.scale fp32 per 128 x 128 block, per expert
    w1 = exported["layers.0.ffn.experts.3.w1.weight"]
    assert w1.dtype == torch.float8_e4m3fn and w1.shape == (CFG.moe_inter, CFG.hidden)
    assert exported["layers.0.ffn.experts.3.w1.scale"].shape == (CFG.moe_inter // 128, CFG.hidden // 128)
    assert exported["layers.0.attn.wq_a.scale"].dtype == torch.float32
    assert exported["layers.0.hc_attn_fn"].dtype == torch.float32
    ptrs = rollout.data_ptrs()
    assert dw.refit_(rollout, exported, CFG) == len(exported)
    assert rollout.data_ptrs() == ptrs  # same storage: captured CUDA graphs stay valid
    for k, d in rollout.tensors.items():
        t = trained.tensors[k]
        if isinstance(d, Fp8Weight):
            assert_bitwise_equal(d.q, t.q, k)
            assert_bitwise_equal(d.scale, t.scale, k)
        else:
            assert_bitwise_equal(d, t, k)
    bad = dict(exported)
    bad["layers.1.attn.wo.weight"] = bad["layers.1.attn.wo.weight"][:, :128]
    with pytest.raises(ConfigError, match="layers.1.attn.wo.weight"):
        dw.refit_(rollout, bad, CFG)
    del bad["layers.1.attn.wo.weight"]
    with pytest.raises(ConfigError, match="missing"):
        dw.refit_(rollout, bad, CFG)


def test_make_checkpoint_config_is_refused_naming_every_missing_feature(tmp_path):
    cj = config_dict(ckpt_preset("tiny"))
    with pytest.raises(ConfigError) as e:
        dcfg.model_config_from_checkpoint_config(cj)
    msg = str(e.value)
    for word in ("compress_rates", "sliding_window", "hash_moe", "sqrtsoftplus", "swiglu_limit", "o_groups",
                 "rope_scaling"):
        assert word in msg, word
    (tmp_path / "config.json").write_text(json.dumps(cj))
    with pytest.raises(ConfigError, match="hash-routed MoE"):
        dw.read_actor_checkpoint(tmp_path)


def _cfg(**kw):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                expert_model_parallel_size=1, normalization="RMSNorm", gated_linear_unit=True,
                activation_func=torch.nn.functional.silu, num_moe_experts=8, moe_router_dtype="fp32",
                moe_router_score_function="sigmoid", transformer_impl="local")
    base.update(kw)
    return NS(**base)


def test_guard_refuses_in_one_message_naming_each_setting():
    assert dguard.actor_problems(_cfg()) == []

    class TELayerNormColumnParallelLinear:
        pass

    TELayerNormColumnParallelLinear.__module__ = "megatron.core.extensions.transformer_engine"
    spec = NS(module=object, submodules=NS(linear_qkv=TELayerNormColumnParallelLinear))
    with pytest.raises(ConfigError) as e:
        dguard.check_actor(_cfg(transformer_impl="transformer_engine", tensor_model_parallel_size=2,
                                expert_model_parallel_size=4, context_parallel_size=2, cp_comm_type="p2p",
                                pipeline_model_parallel_size=2, mtp_num_layers=1),
                           updates_per_rollout_step=2, pre_process=False, spec=spec)
    msg = str(e.value)
    for word in ("transformer_impl='transformer_engine'", "tensor_model_parallel_size=2",
                 "expert_model_parallel_size=4", "cp_comm_type='p2p'", "pipeline_model_parallel_size=2",
                 "mtp_num_layers=1", "updates_per_rollout_step=2", "pre_process=False",
                 "TELayerNormColumnParallelLinear"):
        assert word in msg, word
    assert msg.count("\n  - ") == 9
    # CP with the all-gather is fine for Megatron's own attention, not for the actor's
    with pytest.raises(ConfigError, match="context_parallel_size=2: the actor"):
        dguard.check_actor(_cfg(context_parallel_size=2, cp_comm_type="all_gather"))


# ------------------------------------------------------------------------------------ the actor (megatron)
def test_model_provider_builds_a_megatron_module_from_a_transformer_config(megatron, masters):
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
    from zerodiff.integrations.megatron.dsv4 import model_provider

    m = model_provider(pre_process=True, post_process=True)
    assert isinstance(m, MegatronModule) and isinstance(m.config, TransformerConfig)
    assert m.model_cfg == CFG and m.config.transformer_impl == "local" and not m.config.multi_latent_attention
    named = dict(m.named_parameters())
    assert set(named) == {r[1] for r in dw.mapping(CFG)}
    for h, mod, _ in dw.mapping(CFG):
        assert named[mod] is m.masters[h]  # the optimizer's params are the forward's masters
        assert named[mod].requires_grad == masters[h].requires_grad
    with pytest.raises(ConfigError, match="post_process=False"):
        model_provider(pre_process=True, post_process=False)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2"):
        model_provider(tensor_model_parallel_size=2)


def test_checkpoint_load_is_bit_exact_and_refuses_without_masters(megatron, masters, tmp_path):
    import shutil

    from zerodiff.checkpoint.dsv4 import read_checkpoint
    from zerodiff.integrations.megatron.dsv4 import build_from_checkpoint, save_checkpoint

    save_checkpoint(_actor(masters), tmp_path / "ck")
    m, how = build_from_checkpoint(tmp_path / "ck")
    assert how == "masters"
    for k, v in masters.items():
        assert_bitwise_equal(m.masters[k].detach(), v.detach(), k)
    _, files = read_checkpoint(tmp_path / "ck")  # the FP8 shards are the harness deployment's bytes
    dep = Deployment(masters)
    assert_bitwise_equal(files["layers.1.attn.wq_b.weight"], dep.tensors["layers.1.wq_b"].q)
    assert_bitwise_equal(files["layers.1.ffn.experts.5.w2.scale"], dep.tensors["layers.1.exp_w2"].scale[5])
    shutil.rmtree(tmp_path / "ck" / "masters")
    with pytest.raises(ConfigError, match="no masters/"):
        build_from_checkpoint(tmp_path / "ck")
    d, how = build_from_checkpoint(tmp_path / "ck", dequantize=True)
    assert how == "dequantized"
    assert_bitwise_equal(d.masters["embed"].detach(), masters["embed"].detach())  # stored as is


def test_logprobs_equal_the_rollout_engine_and_the_training_forward(megatron, masters):
    """Megatron-RL's path (``model(tokens)`` then ``selective_log_softmax``), the 0008-routed
    ``zerodiff.integrations.megatron.selective_log_softmax`` on the same logits, and the cross-entropy path all
    give the rollout's sampled-token log-probs bit for bit; so does the harness training forward."""
    from zerodiff.integrations import megatron as zm
    from zerodiff.integrations.megatron.dsv4.acceptance import _pad, actor_logprobs

    out = _rollout(masters)
    seqs = [(k, o.prompt, o.response) for k, o in sorted(out.items())]
    m = _actor(masters)
    for path in ("selective", "cross_entropy"):
        lp = actor_logprobs(m, seqs, path=path, micro=4)
        for k, o in out.items():
            assert_bitwise_equal(lp[k], o.logprobs, f"{path} {k}")
    ids, lens = _pad(seqs, "cpu")
    with torch.no_grad():
        logits = m(ids, lengths=lens)
    routed = zm.selective_log_softmax(logits[:, :-1], ids[:, 1:])
    for b, (k, p, r) in enumerate(seqs):
        assert_bitwise_equal(routed[b, len(p) - 1: len(p) - 1 + len(r)], out[k].logprobs, f"routed {k}")
    trainer = TrainingForward(CPU, {k: v for k, v in masters.items()}, Deployment(masters),
                              make_ops("consistent", "train", CFG))
    lt = trainer.run(seqs, pack_seed=5)
    for k, o in out.items():
        assert_bitwise_equal(lt[k], o.logprobs, f"trainer {k}")
    # rows, padding and batch size change no bit: one sequence alone == inside the padded batch
    alone = actor_logprobs(m, seqs[2:3])
    assert_bitwise_equal(alone[seqs[2][0]], out[seqs[2][0]].logprobs)


def test_optimizer_step_reaches_the_next_forward(megatron, masters, monkeypatch):
    """megatron-core's Float16OptimizerWithFloat16Params writes the BF16 masters through ``.data`` (no version
    bump); the next actor forward must run the new masters (== a fresh actor holding them). Control: with the
    deployment refresh disabled (the stale-weight defect) the same check fails."""
    from zerodiff.integrations.megatron.dsv4 import build_optimizer

    m = _actor(masters)
    opt = build_optimizer(m, lr=1e-2)
    assert opt.cls_name == "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params"
    ids = torch.randint(0, CFG.vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = m(ids)
    m(ids, labels=ids.roll(-1, 1)).sum().backward()
    w = m.masters["layers.0.wq_a"]
    version, old = w._version, w.detach().clone()
    assert opt.step()
    assert not torch.equal(w.detach(), old) and w._version == version  # the defect's premise
    assert not torch.equal(m.masters["layers.0.attn_hc_fn"].detach(), masters["layers.0.attn_hc_fn"])  # FP32 too
    fresh = _actor({k: p.detach() for k, p in m.masters.items()})
    with torch.no_grad():
        after, want = m(ids), fresh(ids)
    assert not torch.equal(before, want)
    assert_bitwise_equal(after, want)
    # negative control: a deployment that is not requantised from the masters serves the old weights
    stale = _actor(masters)
    stale.refresh_deployment()
    with torch.no_grad():
        for k, p in stale.masters.items():
            p.data.copy_(m.masters[k].detach())
    monkeypatch.setattr(Deployment, "update_", lambda self, masters: None)
    with torch.no_grad():
        assert not torch.equal(stale(ids), want)


def test_actor_parameters_get_the_training_forwards_gradients(megatron, masters):
    """The actor's backward is the harness's training backward: through the actor's own parameters it passes the
    tight gradient check (every tensor within its recorded bound), its gradients equal the harness training
    module's bit for bit, and Megatron-RL's log-prob path gives the same gradients up to BF16 accumulation."""
    from zerodiff.integrations.megatron.dsv4 import build_model
    from zerodiff.integrations.megatron.dsv4.acceptance import actor_logprobs
    from zerodiff.training.gradcheck import RECORDED_CPU, recorded_recipe, tight_bounds, tight_gradient_check

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run, seqs, coef = recorded_recipe()
        m = build_model(run.cfg)
        m.load_masters({k: v.detach() for k, v in run.masters.items()})
        trainer = TrainingForward(run.preset, m.masters, m.refresh_deployment(), m.ops)
        errs = tight_gradient_check(trainer, seqs, coef)
        bounds = tight_bounds(RECORDED_CPU)
        assert set(errs) == set(RECORDED_CPU)
        assert not {k: e["rel_err"] for k, e in errs.items() if e["rel_err"] > bounds[k]}
        for p in list(m.parameters()) + list(run.masters.values()):
            p.grad = None
        trainer.run(seqs, pack_seed=0, grad=True, coef=coef)
        run.trainer.run(seqs, pack_seed=0, grad=True, coef=coef)
        got = {k: p.grad.clone() for k, p in m.masters.items() if p.grad is not None}
        assert set(got) == {k for k, p in run.masters.items() if p.grad is not None} and got
        for k, g in got.items():
            assert_bitwise_equal(g, run.masters[k].grad, k)
        for p in m.parameters():
            p.grad = None
        lp = actor_logprobs(m, seqs, grad=True)
        sum(-float(coef[k]) * lp[k].sum() for k, _, _ in seqs if coef.get(k)).backward()
        for k, g in got.items():
            rel = float((m.masters[k].grad.float() - g.float()).norm() / g.float().norm())
            assert rel < 2e-2, (k, rel)
    finally:
        torch.set_num_threads(old)


def test_sharded_state_dict_and_state_dict_round_trip(parallel_state, masters):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    m = _actor(masters)
    sd = m.sharded_state_dict()
    assert set(sd) == {r[1] for r in dw.mapping(CFG)}
    assert all(isinstance(v, ShardedTensor) for v in sd.values())
    assert sd["decoder.layers.0.mlp.experts.weight1"].global_shape == (CFG.experts, 2 * CFG.moe_inter, CFG.hidden)
    other = _actor({k: torch.zeros_like(v) for k, v in masters.items()})
    other.load_state_dict({k: v.clone() for k, v in m.state_dict().items()})
    for k in masters:
        assert_bitwise_equal(other.masters[k].detach(), m.masters[k].detach(), k)


def test_megatron_check_cli_short_run_passes(megatron, tmp_path, capsys):
    from zerodiff.cli import main

    out = tmp_path / "r.json"
    rc = main(["megatron-check", "--steps", "1", "--concurrency", "12", "--json", str(out),
               "--workdir", str(tmp_path / "w")])
    res = json.loads(out.read_text())
    assert rc == 0, {k: v for k, v in res.items() if k != "checks"}
    for key in ("trainer", "megatron_version", "rollout_engine", "device", "date", "steps", "tokens",
                "tokens_differ", "probs_diff_max", "k3_kl", "refit_checked", "restore_checked"):
        assert key in res, key
    assert res["rollout_engine"] == "zerodiff rollout engine" and res["megatron_version"].startswith("0.19.2")
    assert res["tokens"] > 0 and res["tokens_differ"] == 0 and res["probs_diff_max"] == 0.0 and res["k3_kl"] == 0.0
    assert res["refit_checked"] and res["restore_checked"] and res["stale_weight_checked"]
    assert res["optimizer"].endswith("Float16OptimizerWithFloat16Params")
    assert "PASS" in capsys.readouterr().out


def test_megatron_check_refuses_a_make_checkpoint_directory(megatron, tmp_path, capsys):
    from zerodiff.cli import main

    (tmp_path / "config.json").write_text(json.dumps(config_dict(ckpt_preset("mini"))))
    assert main(["megatron-check", "--checkpoint", str(tmp_path), "--steps", "1"]) == 2
    assert "hash-routed MoE" in capsys.readouterr().err


@pytest.mark.gpu
def test_megatron_check_on_cuda(megatron, tmp_path):
    """The same acceptance on the GPU (gpu_small preset: CUDA kernels, CUDA-graph decode in the rollout)."""
    from zerodiff.cli import main

    out = tmp_path / "r.json"
    rc = main(["megatron-check", "--device", "cuda", "--steps", "2", "--json", str(out),
               "--workdir", str(tmp_path / "w")])
    res = json.loads(out.read_text())
    assert rc == 0, {k: v for k, v in res.items() if k != "checks"}
    assert res["tokens_differ"] == 0 and res["refit_checked"] and res["restore_checked"]


def test_forward_checks_positions_and_labels_path_matches_logits(megatron, masters):
    from zerodiff.integrations.megatron.dsv4.functions import selective_log_softmax

    m = _actor(masters)
    ids = torch.randint(0, CFG.vocab, (3, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = m(ids, position_ids=torch.arange(20)[None, :])
        loss = m(ids, labels=ids.roll(-1, 1), lengths=[20, 13, 7])
    assert logits.dtype == torch.float32 and logits.shape == (3, 20, CFG.vocab)
    lp = selective_log_softmax(logits, ids.roll(-1, 1))
    assert_bitwise_equal(-loss[0], lp[0])
    assert_bitwise_equal(-loss[1, :13], lp[1, :13])  # a shorter row: its own values, zero after its length
    assert torch.equal(loss[2, 7:], torch.zeros(13))
    with pytest.raises(ValueError, match="position_ids"):
        m(ids, position_ids=torch.arange(1, 21)[None, :])


def test_checkpoint_coverage_of_the_tiny_checkpoint_names_what_has_no_counterpart():
    rows = dw.checkpoint_coverage(config_dict(ckpt_preset("tiny")))
    assert len(rows) == 532  # every tensor of the tiny checkpoint (docs/checkpoint.md)
    mapped = {n: m for n, m, _ in rows if m}
    assert mapped["layers.1.ffn.experts.7.w3.weight"] == "decoder.layers.1.mlp.experts.weight1"
    assert mapped["layers.0.attn.wq_a.scale"] == "decoder.layers.0.self_attention.linear_q_down_proj.weight (scale)"
    missing = {why for _, m, why in rows if m is None}
    assert missing == {"compressed attention (C4A / C128A compressor)", "grouped output LoRA (wo_a / wo_b)",
                       "attention sinks", "the final mHC head (hc_head)", "hash-routed MoE (token-id table)"}
