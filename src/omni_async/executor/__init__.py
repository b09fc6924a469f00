"""executor layer."""

from omni_async.executor.handle import RequestHandle

__all__ = ["RequestHandle"]
