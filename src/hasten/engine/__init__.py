"""The decode engine: one loop, one verifier, one cache interface."""
