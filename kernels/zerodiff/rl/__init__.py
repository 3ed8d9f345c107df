"""zerodiff end-to-end harness: rl."""
