"""The DeepSeek-V4 actor: a megatron-core ``MegatronModule`` whose forward is zerodiff's training forward.

Structure (parameter names: :mod:`.weights`)::

    DSV4Model
      embedding.word_embeddings           BF16 [V, H]
      decoder.layers[l]
        attn_hc (HyperConnection)         mHC of the attention sub-layer: fn, scale, base (FP32)
        input_layernorm (RMSNorm)
        self_attention (Attention)        q down / q norm / q up, kv down / kv norm, output projection
          indexer (Indexer)               DSA indexer: q up, k, head weights (not trained)
        mlp_hc (HyperConnection)          mHC of the MoE sub-layer
        pre_mlp_layernorm (RMSNorm)
        mlp (MoE)
          router                          weight BF16 [E, H], expert_bias FP32 [E] (not trained)
          experts (GroupedExperts)        weight1 [E, 2I, H] (gate | up), weight2 [E, H, I]
          shared_experts (SharedExpert)   linear_fc1 [2Is, H], linear_fc2 [H, Is]
      decoder.final_layernorm
      output_layer                        BF16 [V, H]

Forward: the modules hold the BF16 / FP32 masters; :meth:`DSV4Model.forward` runs
``zerodiff.model.forward.forward_step`` on them, the function the zerodiff rollout engine runs, with a
:class:`zerodiff.model.ops.ConsistentOps` whose training tape is on while grad is enabled. Per op (the same call
on both sides): mHC pre / post (``ops.mhc``), RMSNorm, block-FP8 linears from the actor's private deployment
(requantised from the masters IN PLACE before every forward, so optimizer writes through ``param.data`` are
always seen), the K path written through the FP8 KV cache round trip into a private paged cache, the DSA
indexer scores + deterministic Top-K, sparse MLA read through the one cache read path, FP32 router GEMM +
sigmoid routing with bias, routed experts in the contiguous layout + shared expert, FP32-output LM head.
Values are the kernels' bits; the backward is the training tape's STE graph to the masters (each master
enters through a version guard).

Batch: ``input_ids`` ``[B, S]``, each row one sequence (request) from position 0; ``lengths`` (optional,
``[B]``) marks right padding. A row's values depend only on its own tokens (the ops are per token and the
attention reads only the row's own earlier positions), so rows, padding and batch size never change a bit.

Pipeline / tensor / context / expert parallelism are refused (:mod:`.guard`).
"""

from __future__ import annotations

import torch

from ....model.cache import PagedCache
from ....model.config import ModelConfig
from ....model.forward import build_step, forward_step
from ....model.ops import ConsistentOps, Tape
from ....model.weights import Deployment, is_trainable, param_shapes
from .config import DSV4Fields, dsv4_fields, model_config, transformer_config
from .mcore import import_megatron
from .weights import module_name

import_megatron()
from megatron.core.transformer.module import MegatronModule  # noqa: E402


def _param(shape, dtype, device, trainable=True):
    return torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=trainable)


class _Holder(MegatronModule):
    """A module that only holds parameters (its computation is part of :meth:`DSV4Model.forward`)."""

    def __init__(self, config, params: dict):
        super().__init__(config=config)
        for k, p in params.items():
            self.register_parameter(k, p)


class HyperConnection(_Holder):
    """mHC mixing of the ``hc_mult`` residual streams: ``zerodiff.ops.mhc.mhc_pre`` / ``mhc_post``."""


class RMSNorm(_Holder):
    """``zerodiff.ops.rmsnorm`` (CUDA) / its exact CPU counterpart."""


class Linear(_Holder):
    """A block-FP8 (or BF16) linear without bias: ``zerodiff.ops.fp8_gemm.fp8_linear`` on the requantised master."""


class Indexer(MegatronModule):
    """DSA indexer: FP8 q / k projections, BF16 head weights; ``zerodiff.ops.indexer`` + ``ops.topk``."""


class Attention(MegatronModule):
    """Sparse MLA over the FP8 KV cache (``zerodiff.ops.kv_cache`` + ``ops.attention``)."""


class Router(_Holder):
    """FP32 router GEMM (``ops.router_gemm``) + sigmoid top-k with expert bias (``ops.moe.route``)."""


class GroupedExperts(_Holder):
    """Routed experts, contiguous layout, FP32 combine in slot order (``ops.moe.moe_experts``)."""


class SharedExpert(MegatronModule):
    """The shared expert (block-FP8 SwiGLU MLP)."""


class MoE(MegatronModule):
    """Router + routed experts + shared expert, one rounding of the sum."""


class Layer(MegatronModule):
    """One DeepSeek-V4 block: mHC(attention) then mHC(MoE)."""


class Decoder(MegatronModule):
    pass


class Embedding(MegatronModule):
    pass


class DSV4Model(MegatronModule):
    """DeepSeek-V4 actor (see the module docstring).

    ``DSV4Model(config, fields=None, *, pre_process=True, post_process=True, device='cpu')``: ``config`` a
    megatron-core ``TransformerConfig`` (:func:`.config.transformer_config`), ``fields`` the
    :class:`.config.DSV4Fields` it has no place for. Parameters start at zero: load masters with
    :meth:`load_masters` (or a checkpoint: :func:`.build_from_checkpoint`)."""

    def __init__(self, config, fields: DSV4Fields, *, pre_process: bool = True, post_process: bool = True,
                 device="cpu"):
        from .guard import check_actor

        check_actor(config, pre_process=pre_process, post_process=post_process)
        super().__init__(config=config)
        self.fields = fields
        self.model_cfg: ModelConfig = model_config(config, fields)
        self.pre_process, self.post_process = pre_process, post_process
        dev = torch.device(device)
        cfg = self.model_cfg
        P = {n: _param(shape, dtype, dev, is_trainable(n)) for n, (shape, dtype, _) in param_shapes(cfg).items()}
        L = lambda l, s: P[f"layers.{l}.{s}"]  # noqa: E731

        def hc(l, sub):
            return HyperConnection(config, {"fn": L(l, f"{sub}_hc_fn"), "scale": L(l, f"{sub}_hc_scale"),
                                            "base": L(l, f"{sub}_hc_base")})

        def norm(p):
            return RMSNorm(config, {"weight": p})

        def lin(p):
            return Linear(config, {"weight": p})

        self.embedding = Embedding(config=config)
        self.embedding.word_embeddings = Linear(config, {"weight": P["embed"]})
        self.decoder = Decoder(config=config)
        self.decoder.layers = torch.nn.ModuleList()
        for l in range(cfg.layers):
            layer = Layer(config=config)
            layer.attn_hc = hc(l, "attn")
            layer.input_layernorm = norm(L(l, "attn_norm"))
            att = Attention(config=config)
            att.linear_q_down_proj = lin(L(l, "wq_a"))
            att.q_layernorm = norm(L(l, "q_norm"))
            att.linear_q_up_proj = lin(L(l, "wq_b"))
            att.linear_kv_down_proj = lin(L(l, "wkv_a"))
            att.kv_layernorm = norm(L(l, "kv_norm"))
            att.linear_proj = lin(L(l, "wo"))
            att.indexer = Indexer(config=config)
            att.indexer.linear_wq_b = lin(L(l, "idx_wq"))
            att.indexer.linear_wk = lin(L(l, "idx_wk"))
            att.indexer.linear_weights_proj = lin(L(l, "idx_ww"))
            layer.self_attention = att
            layer.mlp_hc = hc(l, "ffn")
            layer.pre_mlp_layernorm = norm(L(l, "ffn_norm"))
            moe = MoE(config=config)
            moe.router = Router(config, {"weight": L(l, "gate"), "expert_bias": L(l, "gate_bias")})
            moe.experts = GroupedExperts(config, {"weight1": L(l, "exp_w13"), "weight2": L(l, "exp_w2")})
            moe.shared_experts = SharedExpert(config=config)
            moe.shared_experts.linear_fc1 = lin(L(l, "sh_w13"))
            moe.shared_experts.linear_fc2 = lin(L(l, "sh_w2"))
            layer.mlp = moe
            self.decoder.layers.append(layer)
        self.decoder.final_layernorm = norm(P["final_norm"])
        self.output_layer = lin(P["lm_head"])
        named = dict(self.named_parameters())
        #: harness name -> the module's Parameter (the SAME objects: what the optimizer updates is what runs)
        self.masters = {n: named[module_name(n)] for n in P}
        assert all(self.masters[n] is P[n] for n in P)
        self.ops = ConsistentOps(cfg)
        self.deployment: Deployment | None = None
        self._cache: PagedCache | None = None
        #: tokens per block of the private paged FP8 cache (the values do not depend on it; the acceptance uses
        #: the rollout's)
        self.block_size = 64

    # ---- weights -------------------------------------------------------------------------------------
    def load_masters(self, masters: dict) -> None:
        """Copy harness-named masters into the parameters, bit for bit (shape and dtype must match)."""
        with torch.no_grad():
            for n, p in self.masters.items():
                src = masters[n]
                if src.shape != p.shape or src.dtype != p.dtype:
                    from ... import ConfigError

                    raise ConfigError(f"zerodiff actor: master {n} is {tuple(src.shape)} {src.dtype}, the model "
                                      f"holds {tuple(p.shape)} {p.dtype}")
                p.copy_(src.detach().to(p.device))
        self.refresh_deployment()

    def refresh_deployment(self) -> Deployment:
        """Requantise the private FP8 deployment from the current masters, in place (created on first use)."""
        if self.deployment is None:
            self.deployment = Deployment(self.masters)
        else:
            self.deployment.update_(self.masters)
        return self.deployment

    # ---- forward -------------------------------------------------------------------------------------
    def _cache_for(self, blocks: int, device) -> PagedCache:
        c = self._cache
        if c is None or c.num_blocks < blocks or c.device != torch.device(device):
            c = self._cache = PagedCache(self.model_cfg, max(blocks, 16), self.block_size, device)
        c.allocator = type(c.allocator)(c.num_blocks)
        return c

    def forward(self, input_ids: torch.Tensor, position_ids=None, attention_mask=None, labels=None, *,
                lengths=None):
        """``input_ids`` int64 ``[B, S]`` -> FP32 logits ``[B, S, V]`` (rows past ``lengths[b]`` are zero), or with
        ``labels`` ``[B, S]`` the per-token loss ``-log p(labels)`` (``[B, S]``, zero past ``lengths``) through the
        cross-entropy path (:func:`.functions.cross_entropy`). ``position_ids``, when given, must be
        ``arange(S)`` per row (each row is a sequence from position 0); ``attention_mask`` is not read: the
        attention is causal within each row by construction."""
        if input_ids.dim() != 2:
            raise ValueError(f"zerodiff actor: input_ids must be [B, S], got {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        dev = input_ids.device
        if position_ids is not None:
            want = torch.arange(S, device=position_ids.device).expand(B, S)
            ok = tuple(position_ids.shape) in ((B, S), (1, S)) and torch.equal(position_ids.expand(B, S).long(), want)
            if not ok:
                raise ValueError("zerodiff actor: position_ids must be arange(S) per row (one sequence per row)")
        lens = [S] * B if lengths is None else [int(x) for x in lengths]
        bs = self.block_size
        nblk = sum((n + bs - 1) // bs for n in lens)
        cache = self._cache_for(nblk, dev)
        rows = input_ids.tolist()
        seqs = []
        for b in range(B):
            n = lens[b]
            seqs.append({"tokens": rows[b][:n], "start": 0, "blocks": cache.allocator.alloc((n + bs - 1) // bs),
                         "key": b, "logits_set": set(range(n))})
        step = build_step(seqs, dev)
        dep = self.refresh_deployment()
        grad = torch.is_grad_enabled()
        self.ops.tape = Tape() if grad else None
        try:
            logits = forward_step((dep, self.masters if grad else None), step, cache, self.ops)
            logits = self.ops.attach(logits)
        finally:
            self.ops.tape = None
        mask = torch.arange(S, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
        out = logits.new_zeros(B, S, logits.shape[-1])
        out = _scatter_rows(out, mask, logits)
        if labels is None:
            return out
        from .functions import cross_entropy

        loss = cross_entropy(out, labels.long())
        return loss * mask


def _scatter_rows(out, mask, rows):
    idx = mask.reshape(-1).nonzero(as_tuple=True)[0]
    flat = out.reshape(-1, out.shape[-1]).index_put((idx,), rows)
    return flat.view(out.shape)


def build_model(model_cfg: ModelConfig, *, pre_process: bool = True, post_process: bool = True, device="cpu",
                **config_overrides) -> DSV4Model:
    """An actor for the harness model ``model_cfg`` (parameters zero until loaded)."""
    return DSV4Model(transformer_config(model_cfg, **config_overrides), dsv4_fields(model_cfg),
                     pre_process=pre_process, post_process=post_process, device=device)


def model_provider(pre_process: bool = True, post_process: bool = True, *, model_cfg: ModelConfig | None = None,
                   checkpoint=None, device="cpu", **config_overrides) -> DSV4Model:
    """Megatron-style model provider: ``model_provider(pre_process=True, post_process=True)``. With
    ``checkpoint`` the model is built from and loaded with that actor checkpoint; else from ``model_cfg``
    (default: the harness's ``cpu`` preset) with zero parameters."""
    if checkpoint is not None:
        from .weights import read_actor_checkpoint

        cfg, masters, _ = read_actor_checkpoint(checkpoint)
        m = build_model(cfg, pre_process=pre_process, post_process=post_process, device=device, **config_overrides)
        m.load_masters(masters)
        return m
    if model_cfg is None:
        from ....model.config import CPU

        model_cfg = CPU.model
    return build_model(model_cfg, pre_process=pre_process, post_process=post_process, device=device,
                       **config_overrides)
