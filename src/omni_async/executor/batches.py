"""``BatchKeyer``, where the engine imports it from (``omni_async.executor.submitter`` owns
the batched calls now; this name goes once the engine imports it from there)."""

from omni_async.executor.submitter import BatchKeyer

__all__ = ["BatchKeyer"]
