"""worker layer."""
