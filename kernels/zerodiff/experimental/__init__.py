"""Verified variants that did not ship.

Each module holds alternative configurations or kernels of a shipped op, verified by their own tests
(``tests/test_experimental_*.py``) with the same victim-in-batch and negative-control checks as the shipped
kernel, kept for benchmarks and for experiments that switch both sides at once. The shipped path
(``zerodiff.ops``, ``zerodiff.model``, ``zerodiff.integrations``, ``zerodiff.rollout``, ``zerodiff.training``)
never imports this package; ``tests/test_import_graph.py`` checks that.
"""
