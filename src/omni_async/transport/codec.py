"""What one message of the result channel is on the wire: its pickled frame and its bounds.

``dumps_message`` pickles in the caller's thread, so an unpicklable or oversize message
raises at the sender (F5); ``loads_message`` unpickles and validates again, so a message a
peer built by hand is refused, typed, at the reader.  ``omni_async.transport.channel``
states the channel's contract; both of its implementations frame messages here.
"""

from __future__ import annotations

import pickle
from typing import Final

from omni_async.core.errors import ProtocolError, UsageError
from omni_async.core.messages import AsyncDiffusionOutput, check_wire_message
from omni_async.transport.errors import MessageTooLarge, UnpicklableMessage

__all__ = [
    "CREDIT_BYTES",
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_MAX_MESSAGES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PUT_TIMEOUT",
    "dumps_message",
    "loads_message",
    "resolve_timeout",
]

# Packed outputs are small (tensors travel in shared memory): these are generous bounds
# for handles and inline items, far below the reference's fixed 240 MiB ring (F13).
DEFAULT_MAX_MESSAGE_BYTES: Final = 4 << 20
DEFAULT_CAPACITY_BYTES: Final = 8 << 20
DEFAULT_MAX_MESSAGES: Final = 1024
# ``put(msg)`` with no timeout waits this long for room, then raises ChannelFull: a
# stuck pump must surface as an error at the worker, never as a silent hang.
DEFAULT_PUT_TIMEOUT: Final = 60.0
CREDIT_BYTES: Final = 64 << 10


def dumps_message(msg: AsyncDiffusionOutput, max_bytes: int | None) -> bytes:
    """Pickle ``msg`` in the caller's thread; typed errors for a wrong type, unpicklable or oversize."""
    if not isinstance(msg, AsyncDiffusionOutput):
        raise UsageError(f"the result channel carries AsyncDiffusionOutput, got {type(msg).__qualname__}")
    try:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError, ...
        raise UnpicklableMessage(f"cannot pickle {msg.kind} message: {type(exc).__name__}: {exc}") from exc
    if max_bytes is not None and len(data) > max_bytes:
        raise MessageTooLarge(len(data), max_bytes)
    return data


def loads_message(data: bytes) -> AsyncDiffusionOutput:
    """Unpickle and validate one message; anything else is the peer's ``ProtocolError``."""
    try:
        msg = pickle.loads(data)
    except Exception as exc:
        raise ProtocolError(f"undecodable message on the result channel: {type(exc).__name__}: {exc}") from exc
    if not isinstance(msg, AsyncDiffusionOutput):
        raise ProtocolError(f"the result channel carried a {type(msg).__qualname__}, not an AsyncDiffusionOutput")
    # Unpickling skips the constructor and with it the validation, so a message a peer
    # built by hand (a kind that is not its class's, an OUTPUT_READY carrying no
    # DiffusionOutput) would reach the dispatcher and fail there untyped, or half-way
    # through a delivery.  Construct it again: it is refused here, typed, like an
    # undecodable one.
    try:
        return check_wire_message(msg)
    except Exception as exc:
        raise ProtocolError(f"invalid message on the result channel: {type(exc).__name__}: {exc}") from exc


def resolve_timeout(timeout: float | None, default: float | None) -> float | None:
    t = default if timeout is None else timeout
    if t is not None and t < 0:
        raise UsageError(f"timeout must be >= 0, got {t}")
    return t
