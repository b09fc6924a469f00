"""The RPC method names the protocol itself knows (both sides read them from here)."""

from __future__ import annotations

from typing import Final

__all__ = ["ASYNC_METHODS", "CONTROL_METHODS", "DRAIN_BEFORE", "DRAIN_OUTPUTS", "DROP_OUTPUTS", "LOOP_INFO"]

# Forwards that complete in two messages (COMPUTE_DONE, then OUTPUT_READY per output)
# when the call asks for the asynchronous output path.
ASYNC_METHODS: Final = frozenset({"execute_model", "execute_model_batch"})
# Control messages the worker loop answers itself, never forwarded to the model.
DROP_OUTPUTS: Final = "drop_outputs"  # cancel packing of these ids (F15); never answered
LOOP_INFO: Final = "loop_info"
DRAIN_OUTPUTS: Final = "drain_outputs"
CONTROL_METHODS: Final = frozenset({DROP_OUTPUTS, LOOP_INFO, DRAIN_OUTPUTS})
# Model methods that release or replace device memory: the packer must have copied
# every output out before they run (F8).
DRAIN_BEFORE: Final = frozenset({"sleep", "load_weights", "update_weights", "release_memory"})
