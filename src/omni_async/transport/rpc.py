"""How an RPC travels to worker processes: pickled for every rank before any rank gets it.

``Connection.send`` pickles as it writes, so an argument that does not pickle (a
lambda, a lock in a request's params) used to fail half-way through a broadcast --
after the ranks before it got the call -- and reached the caller as a dead transport.
``encode_rpc`` pickles first, in the caller's thread: a failure raises
``RequestNotSendable`` naming the request and the parameter, and no rank has seen
anything.  One payload per rank, not one for all: a CPU tensor pickles (torch's
reduction on ``ForkingPickler``) into a file descriptor handed over once, to one
receiver, so the bytes of one pickling cannot be sent twice.
"""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

from omni_async.core.errors import RequestNotSendable
from omni_async.core.messages import DiffusionRequest, RpcRequest

__all__ = ["encode_rpc", "pickle_problem", "unsendable"]


def encode_rpc(req: RpcRequest, ranks: int) -> list[bytes]:
    """``req`` pickled as ``Connection.send`` would, once per rank (``Connection.send_bytes`` each,
    ``recv`` on the other end); ``RequestNotSendable`` when it does not pickle."""
    try:
        return [bytes(ForkingPickler.dumps(req)) for _ in range(ranks)]
    except Exception as exc:  # PicklingError, TypeError, AttributeError: whatever the object raises
        raise unsendable(req, exc) from exc


def unsendable(req: RpcRequest, cause: BaseException) -> RequestNotSendable:
    """The error for ``req``, which failed to pickle with ``cause``: the first parameter that
    fails alone, found now (the error path pays for the search, never a call that travels)."""
    requests = _requests(req.args)
    for r in requests:
        for key, value in r.params.items():
            if not _pickles(value):
                return RequestNotSendable(req.method, r.request_id, key, cause)
    for i, arg in enumerate(req.args):
        if not isinstance(arg, DiffusionRequest) and not _requests((arg,)) and not _pickles(arg):
            return RequestNotSendable(req.method, None, f"args[{i}]", cause)
    for key, value in req.kwargs.items():
        if not _pickles(value):
            return RequestNotSendable(req.method, None, f"kwargs[{key!r}]", cause)
    return RequestNotSendable(req.method, requests[0].request_id if len(requests) == 1 else None, None, cause)


def _requests(args: tuple[object, ...]) -> list[DiffusionRequest]:
    found: list[DiffusionRequest] = []
    for a in args:
        if isinstance(a, DiffusionRequest):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(r for r in a if isinstance(r, DiffusionRequest))
    return found


def pickle_problem(value: object, *, spawning: bool = False) -> BaseException | None:
    """Why ``value`` cannot travel to another process by pickle, or None when it can.

    Plain pickle first (what it takes, ``ForkingPickler`` takes too, and it hands out
    no file descriptor, a tensor's, that nobody would collect); then
    ``ForkingPickler``, as ``multiprocessing`` pickles.  ``spawning``: the value travels
    as an argument of a process being spawned, where an object that pickles only then
    (a ``multiprocessing`` lock, event or queue: ``RuntimeError`` "... through
    inheritance") travels too.
    """
    try:
        pickle.dumps(value)
        return None
    except Exception:  # noqa: BLE001  # try the pickler multiprocessing uses
        pass
    try:
        ForkingPickler.dumps(value)
        return None
    except RuntimeError as exc:
        return None if spawning and "through inheritance" in str(exc) else exc
    except Exception as exc:  # noqa: BLE001  # PicklingError, TypeError, AttributeError, ...
        return exc


def _pickles(value: object) -> bool:
    return pickle_problem(value) is None
