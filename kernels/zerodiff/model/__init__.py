"""zerodiff end-to-end harness: model."""
