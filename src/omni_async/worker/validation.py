"""What an executor checks about a model before it runs: where its request check lives.

One rule for every executor (issue 17, defect 12): a model's ``validate_request(request)``
must be callable without a model instance -- a ``staticmethod`` or ``classmethod`` of
the model's class, or an attribute of a factory function -- because the executor
runs it in the caller's thread, before a request is queued or sent, and with worker
processes no model instance lives in the caller's process.  An instance method is
refused where the executor is built (``UsageError``), never silently skipped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import cast

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest

__all__ = ["model_batch_keyer", "model_validator"]

Validator = Callable[[DiffusionRequest], None]


def model_validator(owner: object, where: str) -> Validator | None:
    """The ``validate_request`` of ``owner`` (a model class, or a factory function carrying
    one as an attribute), callable without an instance; None when it has none.

    ``UsageError`` when a class defines it as an instance method (``where`` says what
    was being built).
    """
    if isinstance(owner, type):
        hook = inspect.getattr_static(owner, "validate_request", None)
        if hook is None:
            return None
        if inspect.isfunction(hook):  # a plain def in the class body: an instance method
            raise UsageError(
                f"{where}: {owner.__module__}.{owner.__qualname__}.validate_request is an instance method; "
                "the executor runs a model's validate_request in the caller's thread before a request is "
                "queued or sent, where no model instance exists (worker processes): make it a @staticmethod "
                "(or @classmethod) that checks the request's parameters alone, and keep a check that needs "
                "the instance inside the forward"
            )
    hook = getattr(owner, "validate_request", None)
    return cast("Validator", hook) if callable(hook) else None


BatchKeyer = Callable[[DiffusionRequest], Hashable | None]


def model_batch_keyer(owner: object, where: str) -> BatchKeyer | None:
    """The ``batch_key`` of ``owner`` (a model class, or a factory function carrying one as
    an attribute), callable without an instance, by the same rule as ``validate_request``
    (the engine asks it in its own process); None when it has none.

    ``UsageError`` when a class defines it as an instance method."""
    if isinstance(owner, type):
        hook = inspect.getattr_static(owner, "batch_key", None)
        if hook is None:
            return None
        if inspect.isfunction(hook):
            raise UsageError(
                f"{where}: {owner.__module__}.{owner.__qualname__}.batch_key is an instance method; the engine "
                "asks a model's batch_key in its own process, where no model instance exists: make it a "
                "@staticmethod (or @classmethod) that reads the request's parameters alone"
            )
    hook = getattr(owner, "batch_key", None)
    return cast("BatchKeyer", hook) if callable(hook) else None
