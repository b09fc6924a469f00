"""verify layer."""
