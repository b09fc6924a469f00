"""Models whose request check depends on how they are built, and models with a batch key
(issue 19: ``WorkerSpec.request_validator`` with kwargs, ``WorkerSpec.batch_keyer``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable

from helpers.mp_workers import ScriptedWorker
from omni_async.core.errors import InvalidRequest
from omni_async.core.messages import DiffusionRequest


class SizedWorker(ScriptedWorker):
    """Takes requests whose ``size`` is at most the ``max_size`` it is built with."""

    def __init__(self, rank: int = 0, max_size: int = 4) -> None:
        super().__init__(rank)
        self.max_size = max_size

    @classmethod
    def request_validator(cls, max_size: int = 4, **_: object) -> Callable[[DiffusionRequest], None]:
        def check(request: DiffusionRequest) -> None:
            size = request.params.get("size", 1)
            if not isinstance(size, int) or not 0 < size <= max_size:
                raise InvalidRequest(request.request_id, "size", f"must be an int in 1..{max_size}, got {size!r}")

        return check

    @staticmethod
    def validate_request(request: DiffusionRequest) -> None:
        raise AssertionError("request_validator wins over validate_request")

    @staticmethod
    def batch_key(request: DiffusionRequest) -> Hashable | None:
        size = request.params.get("size")
        return None if size is None else ("size", size)


class InstanceKeyed(ScriptedWorker):
    """A batch key as an instance method: refused (the engine has no instance)."""

    def batch_key(self, request: DiffusionRequest) -> Hashable | None:
        return 0


class InstanceConfigured(ScriptedWorker):
    """A request_validator as an instance method: refused."""

    def request_validator(self) -> None:
        return None


class BadValidatorFactory(ScriptedWorker):
    """A request_validator that returns something other than a callable."""

    @staticmethod
    def request_validator(**_: object) -> object:
        return 42
