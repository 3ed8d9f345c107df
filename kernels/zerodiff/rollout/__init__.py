"""zerodiff end-to-end harness: rollout."""
