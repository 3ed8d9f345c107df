"""Stock-path re-implementations used only by benchmarks and negative controls.

Each module restates what an upstream stock path computes (its batch-dependent choices included), so a
benchmark can time it and a negative control can show that its bits move with the batch. Nothing here is
batch-invariant by design, and the shipped ops never call into this package.
"""
