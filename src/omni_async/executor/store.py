"""Output stores: where an executor's packed outputs live between their OUTPUT_READY and
their release, and how a waiter gets one.

An ``OutputStore`` is one collaborator of ``DiffusionExecutor`` (``executor/api.py``),
which owns it and hands it to the others that need it: the registry releases an output
for nobody through ``release_packed`` (its release hook), the output desk delivers a
claimed output through ``receive`` (on the thread ``run_unpack`` picks) and gives a
delivered one back through ``release``, and the synchronous calls give back what an
answer nobody takes carries (``discard_answer``).  Stores:

* ``InlineStore`` (here): outputs that travel whole inside their message
  (``InProcessExecutor``): nothing to unpack, nothing to give back but what the
  caller's release hook does.
* ``PoolStore`` (``executor/pool_store.py``): the executor's shared-memory
  ``SegmentPool``, its budget of held outputs, and what a dead rank held there.
* ``ObjectStore`` (``executor/ray_store.py``): Ray's object store for the ranks on
  other nodes, beside a ``PoolStore`` for the ranks on the executor's.
* ``PathStore`` (``executor/path_store.py``): an output path of the workers' own
  (``WorkerOptions.output_path`` naming an ``OutputPath``: the bench's comparison
  paths, whose outputs live in segments made for each), which reads and frees them.

A store knows nothing of how the ranks are reached (the rank link, ``executor/link.py``),
and the rank link nothing of where outputs live beyond what it is handed.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from omni_async.core.messages import DiffusionOutput
from omni_async.core.registry import ReleaseHook, no_release
from omni_async.transport.budget import OutputBudget

__all__ = ["InlineStore", "OutputStore"]


class OutputStore(abc.ABC):
    """Where packed outputs live (see the module docstring)."""

    @abc.abstractmethod
    def receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        """A claimed output as the waiter gets it (unpacked); ``OutputUnpackFailed`` if it
        cannot be, with whatever it held given back."""

    def run_unpack(self, packed: DiffusionOutput, finish: Callable[[], None]) -> None:
        """Where ``receive`` runs: ``finish()`` here, on the pump's thread, unless the store
        hands a slow read (a transfer) to a thread of its own."""
        finish()

    @abc.abstractmethod
    def release_packed(self, packed: DiffusionOutput) -> None:
        """An output that arrived for nobody (dropped, expired, its waiter gone): give back
        what it holds.  The registry's release hook, called under the pump's lock: it must
        not block (the registry counts what it raises, ``release_errors``)."""

    @abc.abstractmethod
    def release(self, output: DiffusionOutput) -> int:
        """The engine is done with a delivered output (``release_output``): how many
        segments went back."""

    def discard_answer(self, result: object) -> None:  # noqa: B027 (nothing to give back by default)
        """A synchronous answer nobody will take (its call failed or timed out): give back
        the outputs it carries."""

    @property
    def budget(self) -> OutputBudget | None:
        """The budget of held outputs in force (None: no bounded store)."""
        return None

    @property
    def lends_segments(self) -> bool:
        """Whether a delivered output is a zero-copy view of a shared-memory segment of this
        host that the store keeps until ``release`` (the engine's ``sink="segment"``)."""
        return False

    def close(self) -> None:  # noqa: B027 (nothing to close by default)
        """The ranks are stopped: give back everything (idempotent)."""


class InlineStore(OutputStore):
    """Outputs that travel inside their message: delivered as they came; an output for
    nobody goes to ``release_hook`` (a caller's own accounting, ``InProcessExecutor``)."""

    def __init__(self, release_hook: ReleaseHook = no_release) -> None:
        self._release_hook = release_hook

    def receive(self, packed: DiffusionOutput) -> DiffusionOutput:
        return packed

    def release_packed(self, packed: DiffusionOutput) -> None:
        # The registry catches and counts what the hook raises (release_errors).
        self._release_hook(packed)

    def release(self, output: DiffusionOutput) -> int:
        return 0
