"""``zerodiff vllm-check``: engine-level acceptance inside a real (patched) vLLM.

What it checks, on one checkpoint (``zerodiff make-checkpoint``), with offline ``vllm.LLM`` engines:

* **victim in batch**: one victim request (fixed prompt token ids, per-request seed, temperature 1) is run
  alone and then among ``N`` other requests of varied prompt and output lengths, for every ``N`` in
  ``--concurrency`` and at several positions in the submitted list. Its sampled tokens and the float32 bits
  of their log-probs must equal the alone run everywhere.
* **prefill == decode**: the victim's prompt plus its sampled tokens is re-scored by one prefill
  (``prompt_logprobs``), alone and inside a batch; the prompt log-prob of every sampled token must have the
  bits the decode step reported.
* **graphs == eager**: the same victim alone and in batches on an engine with ``enforce_eager=True``.
* **negative control**: the same requests with the switch off (stock vLLM) must show differences in the
  victim and prefill/decode checks, or the acceptance proves nothing and the command fails.

Every engine runs in a subprocess of its own (``ZERODIFF_CONSISTENT`` is read when vLLM's modules are
imported, so each side gets a fresh interpreter), with vLLM's engine core in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profiler sees its kernels. The parent never imports vLLM.

Results: one JSON document (``--json``, written again after every engine so a cut-off run keeps what it
measured; ``--resume PREVIOUS.json`` continues such a run with the engines it did not finish, e.g. when one
command cannot hold every engine's start) with the fields ``engine``, ``vllm_version``, ``torch``, ``device``, ``date``,
``checkpoint_preset``, ``concurrency``, ``requests``, ``victim_tokens``, ``victim_mismatch``,
``prefill_decode_mismatch``, ``graph_eager_mismatch``, ``stock_victim_mismatch``,
``stock_prefill_decode_mismatch`` (token counts; a token counts as a mismatch when its id or its log-prob's
float32 bits differ from the reference at the same index), per-case details, and the resolved engine
configuration each side logged. Exit status 0 only when every consistent-side mismatch is 0 and both stock
controls are above 0.

``--bench`` adds throughput: output tokens/s of the consistent and the stock engine on the same request
stream at each ``--bench-concurrency``, warm-up run outside timing, repeats interleaved between the two
engines (both alive, one running at a time), median and spread, plus the top GPU kernels of each side from
the torch profiler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_CONCURRENCY",
    "Request",
    "make_victim_plan",
    "make_bench_requests",
    "count_mismatch",
    "compare_cases",
    "acceptance_verdict",
    "register",
    "main",
]

DEFAULT_CONCURRENCY = (1, 2, 7, 16, 33, 64, 128, 256)
DEFAULT_BENCH_CONCURRENCY = (64, 128, 256)
EAGER_CONCURRENCY = (7, 64)  # batches the eager engine also runs (besides the victim alone)


@dataclass(frozen=True)
class Request:
    """One request: prompt token ids, number of tokens to sample, per-request sampling seed."""

    prompt: tuple[int, ...]
    max_tokens: int
    seed: int
    prompt_logprobs: bool = False

    def to_json(self) -> dict:
        return {"prompt": list(self.prompt), "max_tokens": self.max_tokens, "seed": self.seed,
                "prompt_logprobs": self.prompt_logprobs}

    @staticmethod
    def from_json(d: dict) -> "Request":
        return Request(tuple(int(t) for t in d["prompt"]), int(d["max_tokens"]), int(d["seed"]),
                       bool(d.get("prompt_logprobs", False)))


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def _prompt(rng, vocab: int, n: int) -> tuple[int, ...]:
    # token 0 and the top of the vocabulary are left out: no special-token meaning can creep in
    return tuple(int(t) for t in rng.integers(1, vocab - 1, size=n))


def _positions(n_total: int) -> list[int]:
    """Victim indices in a submitted list of ``n_total`` requests: first, middle, last (deduplicated)."""
    return sorted({0, n_total // 2, n_total - 1})


def make_victim_plan(vocab: int, *, seed: int = 0, concurrency=DEFAULT_CONCURRENCY, victim_prompt_len: int = 300,
                     victim_tokens: int = 48, filler_prompt=(16, 700), filler_tokens=(4, 96)) -> dict:
    """The victim request and every batch it is placed in, deterministic in ``seed``.

    Returns ``{"victim": Request, "cases": [{"name", "others", "victim_index", "requests": [Request...]}]}``;
    case ``alone`` comes first. Fillers differ from case to case (lengths drawn from the ranges, so they
    finish at different steps and the victim sees prefill chunks and decodes of other requests).
    """
    if vocab < 8:
        raise ValueError(f"vocab={vocab}: too small for a victim plan")
    rng = _rng(seed)
    victim = Request(_prompt(rng, vocab, victim_prompt_len), victim_tokens, 1_000_003 + seed)
    cases = [{"name": "alone", "others": 0, "victim_index": 0, "requests": [victim]}]
    for others in concurrency:
        others = int(others)
        if others < 1:
            raise ValueError(f"concurrency {others}: must be >= 1 (the victim alone is always run)")
        for idx in _positions(others + 1):
            fillers = [Request(_prompt(rng, vocab, int(rng.integers(*filler_prompt))),
                               int(rng.integers(*filler_tokens)), int(rng.integers(1, 2**31 - 1)))
                       for _ in range(others)]
            reqs = fillers[:idx] + [victim] + fillers[idx:]
            cases.append({"name": f"others{others}-at{idx}", "others": others, "victim_index": idx,
                          "requests": reqs})
    return {"victim": victim, "cases": cases}


def rescore_requests(victim: Request, sampled: list[int], fillers: list[Request]) -> list[Request]:
    """The victim's prompt + sampled tokens as one prompt scored by prefill (``prompt_logprobs``), first in
    the list, followed by ``fillers``."""
    r = Request(tuple(victim.prompt) + tuple(sampled), 1, victim.seed, prompt_logprobs=True)
    return [r] + list(fillers)


def make_bench_requests(vocab: int, n: int, *, seed: int = 0, prompt=(1024, 2048), output=(512, 1024)) -> list[Request]:
    """``n`` requests with prompts of ``prompt`` tokens and ``output`` sampled tokens (uniform ranges)."""
    rng = _rng(10_000 + seed)
    return [Request(_prompt(rng, vocab, int(rng.integers(*prompt))), int(rng.integers(*output)),
                    int(rng.integers(1, 2**31 - 1))) for _ in range(n)]


# ------------------------------------------------------------------------------------------- comparison
def f32_bits(x: float) -> int:
    """The float32 bit pattern of a log-prob vLLM returned (a Python float holding a float32 value)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def count_mismatch(ref_tokens, ref_lp, tokens, lp) -> int:
    """Tokens (over the reference's length) whose id or log-prob float32 bits differ; after the first
    differing id every later token counts too, and missing tokens count."""
    n = len(ref_tokens)
    bad = 0
    diverged = False
    for i in range(n):
        if diverged or i >= len(tokens) or tokens[i] != ref_tokens[i]:
            diverged = True
            bad += 1
        elif f32_bits(lp[i]) != f32_bits(ref_lp[i]):
            bad += 1
    return bad + max(0, len(tokens) - n)


def compare_cases(ref: dict, runs: list[dict]) -> tuple[int, list[dict]]:
    """``ref`` / ``runs``: ``{"name", "tokens", "logprobs"}``; total mismatching tokens and per-case rows."""
    rows, total = [], 0
    for r in runs:
        m = count_mismatch(ref["tokens"], ref["logprobs"], r["tokens"], r["logprobs"])
        total += m
        rows.append({"case": r["name"], "mismatch": m})
    return total, rows


def prefill_decode_mismatch(decode: dict, rescored: list[dict]) -> tuple[int, list[dict]]:
    """Sampled tokens whose re-scored prompt log-prob bits differ from the decode log-prob bits."""
    rows, total = [], 0
    for r in rescored:
        plp = r["prompt_logprobs"][-len(decode["tokens"]):] if decode["tokens"] else []
        m = sum(1 for a, b in zip(plp, decode["logprobs"]) if a is None or f32_bits(a) != f32_bits(b))
        m += max(0, len(decode["tokens"]) - len(plp))
        total += m
        rows.append({"case": r["name"], "mismatch": m})
    return total, rows


def acceptance_verdict(doc: dict) -> tuple[bool, list[str]]:
    """Pass when every consistent-side mismatch is 0 and both stock controls differ; reasons otherwise."""
    why = []
    for k in ("victim_mismatch", "prefill_decode_mismatch", "graph_eager_mismatch"):
        v = doc.get(k)
        if v is None:
            why.append(f"{k}: not measured")
        elif v != 0:
            why.append(f"{k}={v}: must be 0")
    for k in ("stock_victim_mismatch", "stock_prefill_decode_mismatch"):
        v = doc.get(k)
        if v is None:
            why.append(f"{k}: not measured (the negative control is required)")
        elif v <= 0:
            why.append(f"{k}={v}: the stock engine shows no difference, so the acceptance proves nothing")
    return not why, why


# ------------------------------------------------------------------------------------------- the engine
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine core in this process (profiler, one env)
    "VLLM_USE_FLASHINFER_SAMPLER": "0",      # FlashInfer is not part of the runtime; the torch sampler runs
    "TOKENIZERS_PARALLELISM": "false",
}


def engine_kwargs(checkpoint: str, *, consistent: bool, eager: bool, max_model_len: int, gpu_memory_utilization: float,
                  max_num_seqs: int) -> dict:
    """``vllm.LLM`` keyword arguments for one side. Both sides: TP 1, FP8 KV cache, no prefix caching,
    token-id prompts. The consistent side also names the MoE (Triton: the expert weights keep the checkpoint
    layout zerodiff reads) and linear (DeepGEMM) backends the guard asks for;
    the stock side keeps vLLM's own choices (the baseline is stock vLLM with its defaults)."""
    kw = dict(model=checkpoint, skip_tokenizer_init=True, tensor_parallel_size=1, kv_cache_dtype="fp8",
              enable_prefix_caching=False, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              gpu_memory_utilization=gpu_memory_utilization, enforce_eager=eager, seed=0, max_logprobs=1)
    if consistent:
        kw.update(moe_backend="triton", linear_backend="deep_gemm")
    return kw


class VllmEngine:
    """A ``vllm.LLM`` behind the small interface the checks use (``generate(requests) -> [result]``)."""

    def __init__(self, kwargs: dict):
        import vllm

        self.vllm = vllm
        self.llm = vllm.LLM(**kwargs)

    def info(self) -> dict:
        import torch

        out: dict[str, Any] = {"vllm_version": getattr(self.vllm, "__version__", "?"),
                               "torch": torch.__version__,
                               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
        cfg = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        if cfg is not None:
            cc = getattr(cfg, "compilation_config", None)
            out["cudagraph_mode"] = str(getattr(cc, "cudagraph_mode", None))
            out["compilation_mode"] = str(getattr(cc, "mode", None))
            mc = getattr(cfg, "model_config", None)
            out["quantization"] = str(getattr(mc, "quantization", None))
            out["kv_cache_dtype"] = str(getattr(getattr(cfg, "cache_config", None), "cache_dtype", None))
            kc = getattr(cfg, "kernel_config", None)
            out["moe_backend"] = str(getattr(kc, "moe_backend", None))
            out["linear_backend"] = str(getattr(kc, "linear_backend", None))
            try:  # the resolved choice (a property of the config: the environment, the model, the platform)
                out["use_v2_model_runner"] = bool(cfg.use_v2_model_runner)
            except Exception:  # noqa: BLE001 - informational only
                pass
        return out

    def generate(self, requests: list[Request]) -> list[dict]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests]
        params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=r.seed, max_tokens=r.max_tokens,
                                 ignore_eos=True, logprobs=0,
                                 prompt_logprobs=0 if r.prompt_logprobs else None, detokenize=False)
                  for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [_result(o, r) for o, r in zip(outs, requests)]


def _lp_of(entry, token: int):
    if entry is None:
        return None
    lp = entry[token] if token in entry else None
    return None if lp is None else float(getattr(lp, "logprob", lp))


def _result(out, req: Request) -> dict:
    c = out.outputs[0]
    tokens = [int(t) for t in c.token_ids]
    lps = list(c.logprobs or [])
    res = {"tokens": tokens, "logprobs": [_lp_of(lps[i] if i < len(lps) else None, t) for i, t in enumerate(tokens)]}
    if req.prompt_logprobs:
        plps = list(out.prompt_logprobs or [])
        res["prompt_logprobs"] = [_lp_of(plps[i] if i < len(plps) else None, t) for i, t in enumerate(req.prompt)]
    return res


# ------------------------------------------------------------------------------------- worker processes
def _worker_main(conn, env: dict, kwargs: dict, factory: str | None) -> None:
    """Child process: set the side's environment, build the engine, then serve commands until ``stop``."""
    os.environ.update({k: v for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        if factory:
            mod, _, name = factory.partition(":")
            import importlib

            engine = getattr(importlib.import_module(mod), name)(kwargs)
        else:
            engine = VllmEngine(kwargs)
        conn.send({"ok": True, "info": engine.info()})
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        import traceback

        conn.send({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        return
    while True:
        cmd = conn.recv()
        op = cmd.get("op")
        if op == "stop":
            conn.send({"ok": True})
            return
        try:
            if op == "generate":
                reqs = [Request.from_json(d) for d in cmd["requests"]]
                t0 = time.perf_counter()
                res = engine.generate(reqs)
                conn.send({"ok": True, "results": res, "seconds": time.perf_counter() - t0})
            elif op == "profile":
                conn.send({"ok": True, "kernels": _profile(engine, [Request.from_json(d) for d in cmd["requests"]],
                                                           int(cmd.get("top", 15)))})
            else:
                conn.send({"ok": False, "error": f"unknown op {op!r}"})
        except BaseException as e:  # noqa: BLE001
            import traceback

            conn.send({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})


def _profile(engine, requests: list[Request], top: int) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        engine.generate(requests)
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = (getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)) if cuda else ev.cpu_time_total
        if t:
            rows.append({"kernel": ev.key[:160], "device_ms": t / 1000.0, "calls": ev.count})
    rows.sort(key=lambda r: -r["device_ms"])
    total = sum(r["device_ms"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["device_ms"] / total
    return rows[:top]


class Worker:
    """A persistent engine subprocess; ``call(op, **kw)`` sends one command and waits for its answer."""

    def __init__(self, name: str, env: dict, kwargs: dict, *, factory: str | None = None, log=None):
        import multiprocessing as mp

        self.name, self.log = name, log or (lambda m: None)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, env, kwargs, factory), name=f"zd-{name}")
        t0 = time.perf_counter()
        self.proc.start()
        child.close()
        first = self._recv()
        if not first.get("ok"):
            self.proc.join(5)
            raise RuntimeError(f"engine '{name}' failed to start: {first.get('error')}\n{first.get('trace', '')}")
        self.info = first["info"]
        self.info["start_seconds"] = round(time.perf_counter() - t0, 1)
        self.log(f"[{name}] engine up in {self.info['start_seconds']} s: {self.info}")

    def _recv(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            return {"ok": False, "error": f"engine process exited with code {self.proc.exitcode}"}

    def call(self, op: str, **kw):
        self.conn.send({"op": op, **kw})
        ans = self._recv()
        if not ans.get("ok"):
            raise RuntimeError(f"engine '{self.name}' {op}: {ans.get('error')}\n{ans.get('trace', '')}")
        return ans

    def generate(self, requests: list[Request]):
        return self.call("generate", requests=[r.to_json() for r in requests])

    def stop(self):
        if self.proc.is_alive():
            try:
                self.conn.send({"op": "stop"})
                self._recv()
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# --------------------------------------------------------------------------------------------- the run
def side_env(consistent: bool, fp8_gemm_backend: str | None = None,
             stock_deep_gemm_warmup: str | None = None) -> dict:
    """The environment of one engine process. The consistent side also pins zerodiff's block-FP8 GEMM backend
    (``ZERODIFF_FP8_GEMM_BACKEND``; both RL sides must use the same) and skips vLLM's DeepGEMM warm-up (its
    linears run zerodiff's GEMM, not vLLM's DeepGEMM kernels). The stock side's ``VLLM_DEEP_GEMM_WARMUP`` is
    ``stock_deep_gemm_warmup`` when given (``skip``: the kernels compile when first met instead of all ~2,100
    at start, which from a cold cache takes longer than 5 minutes on an H200; the values are the same), vLLM's
    default otherwise."""
    env = dict(ENGINE_ENV)
    env["ZERODIFF_CONSISTENT"] = "1" if consistent else None
    if consistent:
        env["VLLM_DEEP_GEMM_WARMUP"] = "skip"
        if fp8_gemm_backend:
            env["ZERODIFF_FP8_GEMM_BACKEND"] = fp8_gemm_backend
    elif stock_deep_gemm_warmup:
        env["VLLM_DEEP_GEMM_WARMUP"] = stock_deep_gemm_warmup
    return env


def victim_runs(worker: Worker, plan: dict, names=None, log=print) -> tuple[dict, list[dict]]:
    """Run the plan's cases (or those named); the victim's result per case."""
    ref, runs = None, []
    for case in plan["cases"]:
        if names is not None and case["name"] not in names:
            continue
        ans = worker.generate(case["requests"])
        v = ans["results"][case["victim_index"]]
        row = {"name": case["name"], "tokens": v["tokens"], "logprobs": v["logprobs"],
               "requests": len(case["requests"]), "seconds": round(ans["seconds"], 3)}
        if case["name"] == "alone":
            ref = row
        else:
            runs.append(row)
        log(f"[{worker.name}] {case['name']}: {len(case['requests'])} requests, {ans['seconds']:.2f} s")
    return ref, runs


def rescore_runs(worker: Worker, plan: dict, decode: dict, log=print) -> list[dict]:
    """The victim re-scored by prefill: alone and with the fillers of two batch cases."""
    out = []
    batch_cases = [c for c in plan["cases"] if c["others"] > 0]
    picks = [("rescore-alone", [])]
    for c in (batch_cases[:1] + batch_cases[-1:]) if batch_cases else []:
        fillers = [r for i, r in enumerate(c["requests"]) if i != c["victim_index"]]
        picks.append((f"rescore-{c['name']}", fillers))
    victim = plan["victim"]
    for name, fillers in picks:
        reqs = rescore_requests(victim, decode["tokens"], fillers)
        ans = worker.generate(reqs)
        out.append({"name": name, "prompt_logprobs": ans["results"][0]["prompt_logprobs"]})
        log(f"[{worker.name}] {name}: {len(reqs)} requests, {ans['seconds']:.2f} s")
    return out


def run_side(label: str, *, consistent: bool, eager: bool, checkpoint: str, plan: dict, args, names=None,
             rescore: bool = True, factory=None, log=print, on_result=None) -> dict:
    """Start one engine, run the victim plan (and the re-scoring) on it, stop it. ``on_result(res)`` is called
    with the results before the engine is stopped, so a run cut off during shutdown keeps them."""
    kw = engine_kwargs(checkpoint, consistent=consistent, eager=eager, max_model_len=args.max_model_len,
                       gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs)
    env = side_env(consistent, args.fp8_gemm_backend, args.stock_deep_gemm_warmup)
    w = Worker(label, env, kw, factory=factory, log=log)
    try:
        ref, runs = victim_runs(w, plan, names=names, log=log)
        res = {"info": dict(w.info, env=env, engine_kwargs=kw), "alone": ref, "runs": runs}
        if rescore:
            res["rescored"] = rescore_runs(w, plan, ref, log=log)
        if on_result is not None:
            on_result(res)
        return res
    finally:
        w.stop()


def summarize(doc: dict, sides: dict) -> dict:
    """Fill the acceptance fields from the per-side results present in ``sides``."""
    cg, ce, sg = sides.get("consistent"), sides.get("consistent_eager"), sides.get("stock")
    doc["side_results"] = sides  # the raw victim results per engine: what --resume continues from
    if cg:
        doc["victim_tokens"] = len(cg["alone"]["tokens"])
        doc["victim_mismatch"], doc["cases"] = compare_cases(cg["alone"], cg["runs"])
        doc["prefill_decode_mismatch"], doc["prefill_decode_cases"] = prefill_decode_mismatch(cg["alone"], cg["rescored"])
        for k in ("vllm_version", "torch", "device"):
            doc[k] = cg["info"].get(k)
        doc["consistent_config"] = cg["info"]
    if cg and ce:
        eager_all = [dict(ce["alone"], name="eager-alone")] + [dict(r, name=f"eager-{r['name']}") for r in ce["runs"]]
        doc["graph_eager_mismatch"], doc["graph_eager_cases"] = compare_cases(cg["alone"], eager_all)
    if sg:
        doc["stock_victim_mismatch"], doc["stock_cases"] = compare_cases(sg["alone"], sg["runs"])
        doc["stock_prefill_decode_mismatch"], doc["stock_prefill_decode_cases"] = prefill_decode_mismatch(
            sg["alone"], sg["rescored"])
        doc["stock_config"] = sg["info"]
        if "vllm_version" not in doc:
            for k in ("vllm_version", "torch", "device"):
                doc[k] = sg["info"].get(k)
    return doc


def _write(path: str | None, doc: dict) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    tmp.replace(p)


def _checkpoint_vocab(checkpoint: str) -> int:
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    return int(cfg["vocab_size"])


def plan_fingerprint(plan: dict) -> str:
    """A sha256 over every request of the plan: two runs can be merged only when they ran the same requests."""
    import hashlib

    h = hashlib.sha256()
    for case in plan["cases"]:
        h.update(json.dumps([case["name"], case["victim_index"], [r.to_json() for r in case["requests"]]]).encode())
    return h.hexdigest()


def load_resume(path: str, fingerprint: str) -> tuple[dict, dict]:
    """The per-engine results of an earlier run of the same plan (``--resume``): ``(sides, previous_doc)``.
    Raises ``ValueError`` naming the setting when the file is unreadable or ran another plan."""
    try:
        prev = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume {path}: cannot read it ({e})") from None
    if prev.get("plan_sha256") != fingerprint:
        raise ValueError(f"--resume {path}: that run used other requests (its --seed / --concurrency / "
                         f"--victim-tokens / checkpoint vocabulary differ); run the same plan or start afresh")
    sides = prev.get("side_results") or {}
    if not isinstance(sides, dict):
        raise ValueError(f"--resume {path}: 'side_results' is not a mapping")
    return {k: v for k, v in sides.items() if k in SIDES}, prev


def _median_spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs), "values": xs}


def run_bench(args, checkpoint: str, vocab: int, doc: dict, factory=None, log=print) -> dict:
    """Consistent vs stock output tokens/s, interleaved repeats, warm-up outside timing, profiler top kernels."""
    sides = {}
    workers = {}
    try:
        for label, consistent in (("consistent", True), ("stock", False)):
            kw = engine_kwargs(checkpoint, consistent=consistent, eager=False, max_model_len=args.max_model_len,
                               gpu_memory_utilization=args.bench_gpu_memory_utilization,
                               max_num_seqs=max(args.max_num_seqs, max(args.bench_concurrency)))
            env = side_env(consistent, args.fp8_gemm_backend, args.stock_deep_gemm_warmup)
            workers[label] = Worker(f"bench-{label}", env, kw, factory=factory, log=log)
        # the profile first: short, it doubles as a first warm-up, and a bench cut off later still has it
        prof_reqs = make_bench_requests(vocab, min(64, max(args.bench_concurrency)), seed=args.seed + 1,
                                        prompt=(256, 512), output=(64, 65))
        for label, w in workers.items():
            w.generate(prof_reqs)  # compile / capture outside the profile
            sides[label] = w.call("profile", requests=[r.to_json() for r in prof_reqs], top=15)["kernels"]
        doc["bench"] = {"rows": [], "top_kernels": sides,
                        "engine_kwargs": {k: w.info for k, w in workers.items()}}
        _write(args.json, doc)
        rows = doc["bench"]["rows"]
        for conc in args.bench_concurrency:
            reqs = make_bench_requests(vocab, conc, seed=args.seed, prompt=tuple(args.bench_prompt),
                                       output=tuple(args.bench_output))
            n_out = sum(r.max_tokens for r in reqs)
            for label, w in workers.items():  # warm-up: JIT, Triton, graphs for this stream's shapes
                w.generate(reqs)
            tps = {k: [] for k in workers}
            for rep in range(args.bench_repeats):
                order = list(workers) if rep % 2 == 0 else list(reversed(list(workers)))
                for label in order:
                    ans = workers[label].generate(reqs)
                    tps[label].append(n_out / ans["seconds"])
                    log(f"[bench] concurrency {conc} rep {rep} {label}: {n_out / ans['seconds']:.0f} tok/s")
            ratios = [c / s for c, s in zip(tps["consistent"], tps["stock"])]
            rows.append({"concurrency": conc, "output_tokens": n_out,
                         "consistent_tok_s": _median_spread(tps["consistent"]),
                         "stock_tok_s": _median_spread(tps["stock"]),
                         "ratio": _median_spread(ratios)})
            _write(args.json, doc)
    finally:
        for w in workers.values():
            w.stop()
    return doc


def cmd_vllm_check(args) -> int:
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    checkpoint = args.checkpoint
    t0 = time.time()
    # the preset is known when this command generates the checkpoint; a given directory is reported as such
    preset = f"unknown (--checkpoint {checkpoint})" if checkpoint else args.preset
    if checkpoint is None:
        checkpoint = str(Path(args.workdir) / f"ckpt-{args.preset}-seed{args.seed}")
        if not (Path(checkpoint) / "config.json").exists():
            from .checkpoint import make_checkpoint

            log(f"writing checkpoint preset {args.preset} seed {args.seed} to {checkpoint}")
            make_checkpoint(checkpoint, args.preset, args.seed)
    vocab = _checkpoint_vocab(checkpoint)
    plan = make_victim_plan(vocab, seed=args.seed, concurrency=args.concurrency, victim_tokens=args.victim_tokens)
    doc: dict[str, Any] = {
        "engine": "vllm", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "checkpoint": checkpoint, "checkpoint_preset": preset, "seed": args.seed,
        "concurrency": [int(c) for c in args.concurrency],
        "requests": sum(len(c["requests"]) for c in plan["cases"]),
        "victim_prompt_tokens": len(plan["victim"].prompt),
        "plan_sha256": plan_fingerprint(plan),
    }
    sides: dict[str, dict] = {}
    if args.resume:
        try:
            sides, prev = load_resume(args.resume, doc["plan_sha256"])
        except ValueError as e:
            log(f"zerodiff vllm-check: {e}")
            return 2
        # what the earlier run could not finish is run again here: its errors and skips are not carried over
        if "bench" in prev and not args.bench:
            doc["bench"] = prev["bench"]
        doc["resumed_from"] = {"path": args.resume, "date": prev.get("date"), "sides": sorted(sides)}
        summarize(doc, sides)
        log(f"resuming {args.resume}: engines already measured: {', '.join(sorted(sides)) or 'none'}")
    factory = args.engine_factory
    eager_cases = {"alone"} | {c["name"] for c in plan["cases"] if c["others"] in EAGER_CONCURRENCY}
    # the negative control before the eager engine: without it the acceptance proves nothing
    order = [("consistent", True, False, None), ("stock", False, False, None),
             ("consistent_eager", True, True, eager_cases)]
    for label, consistent, eager, names in order:
        if label not in args.sides or label in sides:
            continue
        if args.time_budget and time.time() - t0 > args.time_budget:
            doc.setdefault("skipped", []).append(label)
            log(f"[{label}] skipped: time budget {args.time_budget} s spent")
            continue
        def keep(res, label=label):
            sides[label] = res
            summarize(doc, sides)
            doc["seconds"] = round(time.time() - t0, 1)
            _write(args.json, doc)
            log(f"[{label}] results written" + (f" to {args.json}" if args.json else ""))

        try:
            run_side(label, consistent=consistent, eager=eager, checkpoint=checkpoint, plan=plan, args=args,
                     names=names, rescore=(label != "consistent_eager"), factory=factory, log=log, on_result=keep)
        except RuntimeError as e:
            doc.setdefault("errors", {})[label] = str(e)[-4000:]
            log(f"[{label}] FAILED: {str(e)[-2000:]}")
        summarize(doc, sides)
        doc["seconds"] = round(time.time() - t0, 1)
        _write(args.json, doc)
    if args.bench:
        try:
            run_bench(args, checkpoint, vocab, doc, factory=factory, log=log)
        except RuntimeError as e:
            doc.setdefault("errors", {})["bench"] = str(e)[-4000:]
            log(f"[bench] FAILED: {str(e)[-2000:]}")
    ok, why = acceptance_verdict(doc)
    doc["passed"], doc["why"] = ok, why
    doc["seconds"] = round(time.time() - t0, 1)
    _write(args.json, doc)
    for k in ("victim_mismatch", "prefill_decode_mismatch", "graph_eager_mismatch", "stock_victim_mismatch",
              "stock_prefill_decode_mismatch"):
        log(f"{k}: {doc.get(k)}")
    log("vllm-check: PASS" if ok else "vllm-check: FAIL\n  " + "\n  ".join(why))
    return 0 if ok else 1


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated integers, e.g. 1,2,7,16") from None


def _pair(s: str) -> tuple[int, int]:
    v = _int_list(s)
    if len(v) != 2 or v[0] >= v[1] or v[0] < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected LO,HI with 1 <= LO < HI")
    return v[0], v[1]


SIDES = ("consistent", "consistent_eager", "stock")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "vllm-check",
        help="engine-level acceptance inside real vLLM: victim-in-batch, prefill == decode, graphs == eager, "
        "with the stock engine as negative control (optionally throughput)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", help="checkpoint directory (default: write --preset/--seed into --workdir)")
    p.add_argument("--preset", default="tiny", help="checkpoint preset when --checkpoint is not given (tiny)")
    p.add_argument("--workdir", default="/tmp/zerodiff-vllm-check", help="where a generated checkpoint goes")
    p.add_argument("--seed", type=int, default=0, help="plan and checkpoint seed (0)")
    p.add_argument("--concurrency", type=_int_list, default=list(DEFAULT_CONCURRENCY),
                   help="numbers of other requests the victim runs among (default 1,2,7,16,33,64,128,256)")
    p.add_argument("--victim-tokens", type=int, default=48, help="tokens the victim samples (48)")
    p.add_argument("--sides", type=lambda s: [x for x in s.split(",") if x], default=list(SIDES),
                   help=f"which engines to run, comma-separated from {','.join(SIDES)} (all)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="engine max_model_len (2048; the consistency guard caps it at 4 x index_topk)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--time-budget", type=float, default=0.0, help="skip engines not started after S seconds")
    p.add_argument("--bench", action="store_true", help="also time consistent vs stock (interleaved)")
    p.add_argument("--bench-concurrency", type=_int_list, default=list(DEFAULT_BENCH_CONCURRENCY))
    p.add_argument("--bench-prompt", type=_pair, default=(1024, 1280),
                   help="prompt length range LO,HI (HI exclusive; 1024,1280: with --bench-output's default the "
                   "longest request fits the tiny checkpoint's max_model_len 2048 = 4 x index_topk)")
    p.add_argument("--bench-output", type=_pair, default=(512, 768), help="output length range LO,HI (512,768)")
    p.add_argument("--bench-repeats", type=int, default=3)
    p.add_argument("--bench-gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--fp8-gemm-backend", default="triton", choices=["triton", "deepgemm", "auto"],
                   help="zerodiff's block-FP8 GEMM backend on the consistent side (triton: no DeepGEMM JIT or "
                   "probe at start; deepgemm: after its row-invariance probe; auto: zerodiff's per-shape choice)")
    p.add_argument("--stock-deep-gemm-warmup", default="skip", choices=["skip", "relax", "full", "vllm"],
                   help="VLLM_DEEP_GEMM_WARMUP of the stock engines (skip: compile DeepGEMM kernels when first met, "
                   "as every bench warm-up pass does outside timing; vllm: leave vLLM's default, which compiles "
                   "every M at start, minutes from a cold cache)")
    p.add_argument("--json", help="write the results here (rewritten after every engine)")
    p.add_argument("--resume", metavar="PREVIOUS_JSON",
                   help="continue an earlier run of the same plan: engines it measured are not run again")
    p.add_argument("--engine-factory", help=argparse.SUPPRESS)  # module:callable, for tests without a GPU
    p.set_defaults(func=_validated)
    return p


def _validated(args) -> int:
    if args.fp8_gemm_backend == "auto":
        args.fp8_gemm_backend = None
    if args.stock_deep_gemm_warmup == "vllm":
        args.stock_deep_gemm_warmup = None
    bad = [s for s in args.sides if s not in SIDES]
    if bad:
        print(f"zerodiff vllm-check: --sides {','.join(bad)}: unknown; choose from {','.join(SIDES)}",
              file=sys.stderr)
        return 2
    longest = args.bench_prompt[1] - 1 + args.bench_output[1] - 1
    if args.bench and longest > args.max_model_len:
        print(f"zerodiff vllm-check: --bench-prompt {args.bench_prompt[0]},{args.bench_prompt[1]} with --bench-output "
              f"{args.bench_output[0]},{args.bench_output[1]} makes requests of up to {longest} tokens, more than "
              f"--max-model-len {args.max_model_len}", file=sys.stderr)
        return 2
    if args.checkpoint and not (Path(args.checkpoint) / "config.json").exists():
        print(f"zerodiff vllm-check: --checkpoint {args.checkpoint}: no config.json there", file=sys.stderr)
        return 2
    return cmd_vllm_check(args)


def register(subparsers) -> None:
    add_parser(subparsers)


def main(argv=None) -> int:
    from .subcommand import run_command

    return run_command("vllm-check", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
