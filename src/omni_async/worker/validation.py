"""What an executor runs of a model without a model instance: its request check and batch key.

One rule for every executor (issue 17, defect 12): a model's ``validate_request(request)``
must be callable without a model instance -- a ``staticmethod`` or ``classmethod`` of
the model's class, or an attribute of a factory function -- because the executor
runs it in the caller's thread, before a request is queued or sent, and with worker
processes no model instance lives in the caller's process.  An instance method is
refused where the executor is built (``UsageError``), never silently skipped.

Two more hooks follow the same rule (issue 19):

* ``request_validator(**kwargs)``: for a model whose checks depend on how it is built
  (a pipeline's config: its class count, its VAE's scale factor), called once with the
  ``WorkerSpec``'s keyword arguments; it returns the validator (or None).  When a
  factory has both, ``request_validator`` wins: it sees the configuration.
* ``batch_key(request) -> Hashable | None``: which requests may share one batched
  forward (equal keys); None means the request cannot be batched.  The engine groups
  waiting requests by it before they reach a worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Mapping
from typing import cast

from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest

__all__ = ["BatchKeyer", "Validator", "check_model_hooks", "model_batch_keyer", "model_validator", "spec_validator"]

Validator = Callable[[DiffusionRequest], None]
BatchKeyer = Callable[[DiffusionRequest], Hashable | None]


def _hook(owner: object, name: str, where: str, purpose: str) -> object | None:
    """``owner``'s attribute ``name`` when callable without an instance; None when absent.

    ``UsageError`` when a class defines it as an instance method (``purpose`` says
    what the executor does with it, for the message)."""
    if isinstance(owner, type):
        found = inspect.getattr_static(owner, name, None)
        if found is None:
            return None
        if inspect.isfunction(found):  # a plain def in the class body: an instance method
            raise UsageError(
                f"{where}: {owner.__module__}.{owner.__qualname__}.{name} is an instance method; "
                f"the executor {purpose}, where no model instance exists (worker processes): make it a "
                "@staticmethod (or @classmethod) that works without the instance, and keep a check that "
                "needs the instance inside the forward"
            )
    hook = getattr(owner, name, None)
    return hook if callable(hook) else None


def model_validator(owner: object, where: str) -> Validator | None:
    """The ``validate_request`` of ``owner`` (a model class, or a factory function carrying
    one as an attribute), callable without an instance; None when it has none.

    ``UsageError`` when a class defines it as an instance method (``where`` says what
    was being built).
    """
    purpose = "runs a model's validate_request in the caller's thread before a request is queued or sent"
    return cast("Validator | None", _hook(owner, "validate_request", where, purpose))


def spec_validator(owner: object, kwargs: Mapping[str, object], where: str) -> Validator | None:
    """The validator of a model built as ``owner(**kwargs)``: its ``request_validator(**kwargs)``
    when it has one (static or class method, or a factory function's attribute), else its
    ``validate_request`` (``model_validator``); None when it has neither.

    ``UsageError`` for an instance method, or a ``request_validator`` that returns
    something other than a callable or None.
    """
    purpose = "calls a model's request_validator(**kwargs) when it is built, in the caller's process"
    make = _hook(owner, "request_validator", where, purpose)
    if make is None:
        return model_validator(owner, where)
    model_validator(owner, where)  # the one rule holds for validate_request too
    validator = cast("Callable[..., object]", make)(**kwargs)
    if validator is not None and not callable(validator):
        raise UsageError(
            f"{where}: request_validator(**kwargs) must return a callable taking a DiffusionRequest (or None), "
            f"got {type(validator).__name__}"
        )
    return cast("Validator | None", validator)


def model_batch_keyer(owner: object, where: str) -> BatchKeyer | None:
    """The ``batch_key`` of ``owner`` (a model class, or a factory function carrying one),
    callable without an instance; None when it has none (its requests are not batched)."""
    purpose = "runs a model's batch_key in the engine's process to group requests into batches"
    return cast("BatchKeyer | None", _hook(owner, "batch_key", where, purpose))


def check_model_hooks(owner: object, where: str) -> None:
    """Refuse (``UsageError``) a model whose ``validate_request``, ``request_validator`` or
    ``batch_key`` is an instance method, without calling any of them (``WorkerSpec``'s
    construction: ``request_validator`` may load a configuration, which waits for the
    executor)."""
    model_validator(owner, where)
    _hook(owner, "request_validator", where, "calls a model's request_validator(**kwargs) in the caller's process")
    model_batch_keyer(owner, where)
