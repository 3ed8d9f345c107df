"""zerodiff end-to-end harness: the tiny DeepSeek-V4-shaped model.

Public API (see each module's docstring for the contracts)::

    zerodiff.model.config:   ModelConfig, RolloutConfig, TrainConfig, Preset, CPU, GPU_SMALL, H200,
                             preset(name) -> Preset, default_preset_name() -> 'h200' | 'cpu'
    zerodiff.model.weights:  init_masters(cfg, seed, device='cpu') -> {name: Parameter},
                             Deployment(masters) (.tensors, .update_(masters) in place, .data_ptrs(), .get(name, masters))
    zerodiff.model.ops:      make_ops(mode: 'consistent'|'baseline'|'baseline_mixed', side: 'rollout'|'train', cfg)
                             -> ops, MODES (ops class per side), ConsistentOps, BaselineRolloutOps, BaselineTrainOps,
                             Tape, WeightVersionError, BASELINE_CHOICE, CPU_EXACT_OPS
    zerodiff.model.baseline_cuda: the frozen CUDA baseline's stock paths: fp8_linear, moe_routed, flashmla_decode,
                             flashmla_prefill, dequant_tokens, cache_slots; CHOICES / choices_text() (what ran),
                             BaselineUnavailable
    zerodiff.model.forward:  StepInputs, build_step(seqs, device='cpu') -> StepInputs,
                             forward_step(params, step, cache, ops, *, record=None) -> fp32 logits [L, vocab]
    zerodiff.model.cache:    PagedCache(cfg, num_blocks, block_size, device), BlockAllocator
    zerodiff.model.sampling: sample_tokens(logits, seed, req, pos) -> int64 [L]
    zerodiff.rollout.engine: Request(rid, prompt, max_new), RolloutEngine(preset, deployment, ops, device='cpu',
                             sample_seed=0, use_graphs=None).generate(requests, sched_seed, record=None)
                             -> {rid: RolloutResult(rid, prompt, response, logprobs fp32)}
    zerodiff.rollout.graphs: DecodeGraphs(engine, guard=False) (CUDA graphs of pure-decode steps; .capture_all()),
                             host_sync_guard(), HostSyncError
    zerodiff.training.forward:   pack(seqs, micro_tokens, pack_seed), TrainingForward(preset, masters, deployment,
                                 ops, device).run(seqs, pack_seed, *, grad=False, coef=None, record=None,
                                 on_micro=None) -> {key: fp32 log-probs}
    zerodiff.training.gradcheck: gradient_check(trainer, seqs, coef, pack_seed=0, coef_ref=None) -> {group: rel err},
                                 tight_gradient_check(trainer, seqs, coef, pack_seed=0) -> {tensor: {rel_err, ...}},
                                 RECORDED_CPU, tight_bounds(recorded), recorded_recipe(), f64_sequence_logprobs(...)
    zerodiff.rl.report:      diff_report(lp_rollout, lp_train) -> dict (verl names), format_table(reports)
    zerodiff.rl.loop:        RLRun(preset='cpu', seed=0, mode='consistent', device=None).run_step() -> report;
                             .save(path), RLRun.load(path, device=None, preset=None), .locate(step); DiffError
    zerodiff.rl.diverge:     Recorder, first_divergence(rollout_rec, train_rec)
    zerodiff.rl.locate:      OpRecorder(plant=None), first_op_divergence(rollout_rec, train_rec), locate(run, step=None,
                             plant=None) -> dict (op-level: the first op whose output bits differ)
    zerodiff.rl.control:     control_probe(run) -> dict (same inputs / batch / phase probes of the negative control)
    zerodiff.e2e_cli:        register(subparsers) (adds `check`, `bench`, `locate`; check/bench take --time-budget
                             SECONDS; check takes --seeds N, --train-packing), main(argv)
"""
