"""Batch-invariant ops. Each module documents its numerical contract in its docstring."""
