"""zerodiff: batch-invariant kernels shared by RL rollout (vLLM) and the training forward (Megatron).

Every public op lives in ``zerodiff.ops.<name>`` and has a pure-torch reference in
``zerodiff.reference.<name>`` that states its numerical contract. Both sides of an RL job call
the same op functions; results never depend on batch composition, prefill vs decode, or layout.
"""

__version__ = "0.1.0"
