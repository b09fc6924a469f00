"""executor layer."""
