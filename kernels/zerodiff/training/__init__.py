"""zerodiff end-to-end harness: training."""
