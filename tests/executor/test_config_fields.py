"""Every field of every configuration class, and every argument of the executors'
constructors, is checked when it is made (issue 29): a value the field's rule refuses
raises ``InvalidConfig`` (``UsageError`` for ``WorkerOptions.output_path``) naming the
field; a value it accepts is kept.  Nothing else may come out -- no ``AttributeError``,
``OverflowError`` or ``TypeError`` -- whatever the value.

``RULES`` writes each field's rule down once, as a predicate, with values it accepts.
The property test draws from a hostile mix (wrong types, NaN, infinities, zero,
negatives, huge ints, strings, containers, callables) and from those values; the table
must name every field (``test_the_rules_cover_every_field``), so a new field without a
check fails here.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_async.core.config import MAX_SECONDS, Deadlines, InvalidConfig
from omni_async.core.errors import UsageError
from omni_async.executor import config as executor_config
from omni_async.executor.config import (
    ExecutorConfig,
    ExecutorOptions,
    Prewarm,
    ProcessGroupConfig,
    check_in_process_arguments,
    check_multiproc_arguments,
    check_ray_arguments,
)
from omni_async.executor.inprocess import InProcessExecutor
from omni_async.executor.multiproc import MultiprocDiffusionExecutor
from omni_async.executor.ray_executor import RayDiffusionExecutor
from omni_async.transport.channel import InProcessChannel
from omni_async.worker.dist import BACKENDS
from omni_async.worker.host import WorkerOptions, WorkerSpec
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.output_path import OUTPUT_PATH_NAMES, REGISTERED_OUTPUT_PATHS

# WorkerOptions.output_path: a registered name, or the import path of an OutputPath.
OUTPUT_PATHS = (*OUTPUT_PATH_NAMES, *REGISTERED_OUTPUT_PATHS.values())
STEP_MODE_PATHS = ("sync", REGISTERED_OUTPUT_PATHS["sync"])

SPEC = WorkerSpec("omni_async.models.tiny:TinyDiffusionWorker")


# ------------------------------------------------------------------ the rules


def _int(v: object, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _seconds(v: object, *, zero: bool = False) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    return (0 <= v if zero else 0 < v) and v <= MAX_SECONDS


def _device(v: object) -> bool:
    if not isinstance(v, str):
        return False
    try:
        torch.device(v)
    except RuntimeError:
        return False
    return True


def _or_none(rule: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or rule(v)


def _is(kind: type) -> Callable[[object], bool]:
    return lambda v: isinstance(v, kind)


def _one_of(*choices: object) -> Callable[[object], bool]:
    return lambda v: any(type(v) is type(c) and v == c for c in choices)


def _cpu_affinity(v: object) -> bool:
    if v is None or v == "gpu-local":
        return True
    if not isinstance(v, list | tuple | set | frozenset | range):
        return False
    cpus = list(v)
    return bool(cpus) and len(set(cpus)) == len(cpus) and all(_int(c, 0) for c in cpus)


def _bool(v: object) -> bool:
    return isinstance(v, bool)


def _loop_options(v: object) -> bool:
    # InProcessExecutor sets these WorkerLoop arguments itself; loop_options may set the rest.
    settable = set(inspect.signature(WorkerLoop).parameters) - {
        "rank",
        "worker",
        "sender",
        "reply_rank",
        "packer",
        "tracer",
    }
    return isinstance(v, Mapping) and all(k in settable for k in v)


def _resource(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf


def _tuple_of_sizes(v: object) -> bool:
    return isinstance(v, tuple) and all(_int(n, 0) for n in v)


def _prewarm(v: object) -> bool:
    # A Prewarm of an output that travels inline uses no segment: refused (test_prewarm.py).
    return isinstance(v, Prewarm) and v.segment_nbytes(WorkerOptions().inline_threshold) > 0


SECONDS = st.floats(min_value=1e-3, max_value=MAX_SECONDS) | st.integers(1, int(MAX_SECONDS))
SECONDS_OR_ZERO = SECONDS | st.just(0) | st.just(0.0)
POSITIVE = st.integers(1, 2**40)
CALLABLES = st.sampled_from([print, lambda *a: None, WorkerOptions])


@attrs.frozen
class Rule:
    """A field's rule: ``accepts`` (the documented check), ``valid`` (values it accepts),
    ``base`` (the other arguments it is checked with)."""

    accepts: Callable[[object], bool]
    valid: st.SearchStrategy[object]
    base: Mapping[str, object] = attrs.field(factory=dict)
    # What the field keeps of a value it accepts (as given, unless this says otherwise).
    kept: Callable[[object], object] = lambda v: v


DEADLINE = Rule(_or_none(_seconds), st.none() | SECONDS)
WORLD_OF_4 = {"world_size": 4}

# How each target is made from its keyword arguments, and its fields' rules.
Target = Callable[..., object]


def _in_process(**kwargs: Any) -> None:
    args: dict[str, Any] = {
        "make_worker": lambda rank: object(),
        "world_size": 1,
        "reply_rank": 0,
        "step_mode": False,
        "deadlines": None,
        "max_outputs_in_flight": 4,
        "tracer": None,
        "channel": None,
        "make_packer": None,
        "loop_options": None,
        "release_hook": print,
        "validate_request": None,
        "postprocess": None,
        "final_step_async": False,
    }
    args.update(kwargs)
    check_in_process_arguments(args.pop("make_worker"), **args)


def _multiproc(**kwargs: Any) -> None:
    args: dict[str, Any] = {"spec": SPEC, "config": None, "pool": None, "sweep_dead_pools": True}
    args.update(kwargs)
    check_multiproc_arguments(args.pop("spec"), args.pop("config"), **args)


def _ray(**kwargs: Any) -> None:
    args: dict[str, Any] = {
        "spec": SPEC,
        "config": None,
        "num_cpus_per_rank": 1.0,
        "num_gpus_per_rank": None,
        "placement_strategy": "PACK",
        "transport": "auto",
        "fetch_threads": 4,
    }
    args.update(kwargs)
    check_ray_arguments(args.pop("spec"), args.pop("config"), **args)


RULES: dict[Target, tuple[str, dict[str, Rule]]] = {
    Deadlines: (
        "Deadlines.",
        {name: DEADLINE for name in ("compute_timeout", "output_timeout", "rpc_timeout", "cancel_grace")},
    ),
    WorkerOptions: (
        "WorkerOptions.",
        {
            "reply_rank": Rule(lambda v: _int(v, 0), st.integers(0, 64)),
            "device": Rule(_device, st.sampled_from(["cpu", "cuda", "cuda:1", "meta", "cpu:0"])),
            "max_outputs_in_flight": Rule(lambda v: _int(v, 1), POSITIVE),
            "max_bytes_in_flight": Rule(_or_none(lambda v: _int(v, 1)), st.none() | POSITIVE),
            "backpressure_timeout": Rule(_or_none(lambda v: _seconds(v, zero=True)), st.none() | SECONDS_OR_ZERO),
            "inline_threshold": Rule(lambda v: _int(v, 0), st.integers(0, 2**40)),
            "lease_timeout": Rule(_or_none(lambda v: _seconds(v, zero=True)), st.none() | SECONDS_OR_ZERO),
            "output_path": Rule(_one_of(*OUTPUT_PATHS), st.sampled_from(OUTPUT_PATHS)),
            "defer_packing": Rule(_bool, st.booleans()),
            "inference_mode": Rule(_bool, st.booleans()),
            # None, "gpu-local" (base: a CUDA device) or CPU numbers, kept as a sorted tuple.
            "cpu_affinity": Rule(
                _cpu_affinity,
                st.none()
                | st.just("gpu-local")
                | st.lists(st.integers(0, 512), min_size=1, unique=True)
                | st.frozensets(st.integers(0, 512), min_size=1),
                base={"device": "cuda"},
                kept=lambda v: tuple(sorted(v)) if isinstance(v, list | tuple | set | frozenset | range) else v,
            ),
            "copies_in_flight": Rule(lambda v: _int(v, 1), st.integers(1, 8)),
        },
    ),
    ProcessGroupConfig: (
        "process_group.",
        {
            "backend": Rule(_or_none(_one_of(*BACKENDS)), st.none() | st.sampled_from(BACKENDS)),
            "rendezvous": Rule(_one_of("tcp", "file"), st.sampled_from(["tcp", "file"])),
            "timeout": DEADLINE,
        },
    ),
    ExecutorConfig: (
        "",
        {
            "world_size": Rule(lambda v: _int(v, 1), POSITIVE),
            "reply_rank": Rule(lambda v: _int(v, 0) and v < 4, st.integers(0, 3), base=WORLD_OF_4),  # type: ignore[operator]
            "step_mode": Rule(_bool, st.booleans()),
            "deadlines": Rule(_or_none(_is(Deadlines)), st.none() | st.builds(Deadlines, compute_timeout=SECONDS)),
            "options": Rule(
                _or_none(lambda v: isinstance(v, WorkerOptions) and v.output_path not in STEP_MODE_PATHS),
                st.none() | st.builds(WorkerOptions, max_outputs_in_flight=st.integers(1, 8)),
            ),
            "max_held_outputs": Rule(_or_none(lambda v: _int(v, 1)), st.none() | POSITIVE),
            "max_held_bytes": Rule(_or_none(lambda v: _int(v, 1)), st.none() | POSITIVE),
            "copy_outputs": Rule(_bool, st.booleans()),
            "start_timeout": Rule(_seconds, SECONDS),
            "tracer": Rule(_or_none(callable), st.none() | CALLABLES),
            # Request mode (the default): True is step mode's option only.
            "final_step_async": Rule(lambda v: v is False, st.just(False)),
            "prewarm": Rule(_or_none(_prewarm), st.none() | st.builds(Prewarm.of_bytes, POSITIVE)),
            "process_group": Rule(
                lambda v: isinstance(v, (bool, ProcessGroupConfig)),
                st.booleans() | st.builds(ProcessGroupConfig, timeout=st.none() | SECONDS),
            ),
        },
    ),
    Prewarm: (
        "prewarm",
        {
            "leaves": Rule(_tuple_of_sizes, st.lists(st.integers(0, 2**30), max_size=4).map(tuple)),
            "count": Rule(_or_none(lambda v: _int(v, 1)), st.none() | POSITIVE),
            "segment": Rule(_or_none(lambda v: _int(v, 1)), st.none() | POSITIVE),
        },
    ),
    _in_process: (
        "",
        {
            "make_worker": Rule(callable, CALLABLES),
            "world_size": Rule(lambda v: _int(v, 1), POSITIVE),
            "reply_rank": Rule(lambda v: _int(v, 0) and v < 4, st.integers(0, 3), base=WORLD_OF_4),  # type: ignore[operator]
            "step_mode": Rule(_bool, st.booleans()),
            "deadlines": Rule(_or_none(_is(Deadlines)), st.none() | st.builds(Deadlines)),
            "max_outputs_in_flight": Rule(lambda v: _int(v, 1), POSITIVE),
            "tracer": Rule(_or_none(callable), st.none() | CALLABLES),
            "channel": Rule(_or_none(_is(InProcessChannel)), st.none() | st.builds(InProcessChannel)),
            "make_packer": Rule(_or_none(callable), st.none() | CALLABLES),
            "loop_options": Rule(
                _or_none(_loop_options),
                st.none() | st.just({}) | st.just({"backpressure_timeout": 1.0, "clock": None}),
            ),
            "release_hook": Rule(callable, CALLABLES),
            "validate_request": Rule(_or_none(callable), st.none() | CALLABLES),
            "postprocess": Rule(
                _or_none(lambda v: isinstance(v, str) and v != ""), st.none() | st.text(min_size=1, max_size=8)
            ),
            "final_step_async": Rule(lambda v: v is False, st.just(False)),
        },
    ),
    _multiproc: (
        "",
        {
            "spec": Rule(_is(WorkerSpec), st.just(SPEC)),
            "config": Rule(_or_none(_is(ExecutorConfig)), st.none() | st.builds(ExecutorConfig)),
            # A real SegmentPool is accepted too (the executor tests pass one); not made here.
            "pool": Rule(lambda v: v is None, st.none()),
            "sweep_dead_pools": Rule(_bool, st.booleans()),
        },
    ),
    _ray: (
        "",
        {
            "spec": Rule(_is(WorkerSpec), st.just(SPEC)),
            "config": Rule(_or_none(_is(ExecutorConfig)), st.none() | st.builds(ExecutorConfig)),
            "num_cpus_per_rank": Rule(_resource, st.floats(0, 64) | st.integers(0, 64)),
            "num_gpus_per_rank": Rule(_or_none(_resource), st.none() | st.floats(0, 8)),
            "placement_strategy": Rule(
                _one_of("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                st.sampled_from(["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]),
            ),
            "transport": Rule(
                _one_of(*executor_config.RAY_TRANSPORTS), st.sampled_from(["auto", "shm", "object_store"])
            ),
            "fetch_threads": Rule(lambda v: _int(v, 1), st.integers(1, 16)),
        },
    ),
}

CASES = [
    pytest.param(target, name, id=f"{getattr(target, '__name__', target)}.{name}")
    for target, (_, rules) in RULES.items()
    for name in rules
]

# The classic bad values, each tried on every field (the property test finds more).
CLASSIC = [
    "x",
    "5",
    b"5",
    [1],
    object(),
    math.nan,
    math.inf,
    -math.inf,
    0,
    0.0,
    -1,
    -0.5,
    True,
    None,
    MAX_SECONDS * 2,
    10**400,
    10**5000,
]

HOSTILE: st.SearchStrategy[object] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.sampled_from(CLASSIC[:-1]),  # not 10**5000: a value whose repr fails, Hypothesis' reports could not show
    st.text(max_size=6),
    st.binary(max_size=3),
    st.lists(st.integers(), max_size=3),
    st.tuples(st.integers(-3, 3)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    CALLABLES,
)


def _check(target: Target, name: str, value: object) -> None:
    """Make ``target`` with ``name=value``: kept if the rule accepts it, else refused naming it."""
    prefix, rules = RULES[target]
    rule = rules[name]
    # The InvalidConfig.field a refusal carries: "Deadlines.compute_timeout", "world_size";
    # Prewarm's are all "prewarm" (its factories' field), the message naming which.
    field = f"{prefix}{name}" if prefix in ("", "Deadlines.", "WorkerOptions.", "process_group.") else prefix
    try:
        made = target(**{**rule.base, name: value})
    except UsageError as exc:
        assert not rule.accepts(value), f"{field} refused a value its rule accepts, {value!r}: {exc}"
        assert name in str(exc), f"the refusal of {value!r} does not name {name!r}: {exc}"
        if isinstance(exc, InvalidConfig):
            assert exc.field == field, exc
        else:  # WorkerOptions.output_path's own error (InvalidOutputPath, a UsageError and ValueError)
            assert isinstance(exc, ValueError) and field in str(exc), exc
        return
    assert rule.accepts(value), f"{field} accepted {value!r}, which its rule refuses"
    if made is not None:  # a class (not a check function): the value is kept (as given, or as its rule says)
        want = rule.kept(value)
        assert getattr(made, name) is want or getattr(made, name) == want


@pytest.mark.parametrize(("target", "name"), CASES)
@settings(deadline=None)
@given(data=st.data())
def test_every_field_refuses_what_its_rule_refuses_naming_it(target: Target, name: str, data: st.DataObject) -> None:
    rule = RULES[target][1][name]
    _check(target, name, data.draw(HOSTILE | rule.valid, label=name))


@pytest.mark.parametrize(("target", "name"), CASES)
def test_every_field_meets_the_classic_bad_values(target: Target, name: str) -> None:
    """Wrong type, NaN, +-inf, zero, negative, past MAX_SECONDS, past float's range, a
    repr too long to print: each refused naming the field where its rule refuses it."""
    for value in CLASSIC:
        _check(target, name, value)


def test_the_rules_cover_every_field() -> None:
    """A field, or a constructor argument, added without a rule here fails this test."""
    for cls in (Deadlines, WorkerOptions, ProcessGroupConfig, ExecutorConfig, Prewarm):
        assert set(RULES[cls][1]) == {f.name for f in attrs.fields(cls)}, cls
    assert set(ExecutorOptions.__annotations__) == {f.name for f in attrs.fields(ExecutorConfig)}

    def params(fn: Callable[..., object], leave: set[str]) -> set[str]:
        return set(inspect.signature(fn).parameters) - leave

    assert params(InProcessExecutor.__init__, {"self"}) == set(RULES[_in_process][1])
    assert params(check_in_process_arguments, set()) == set(RULES[_in_process][1])
    # ``options``: the ExecutorConfig fields, checked by ExecutorConfig.
    assert params(MultiprocDiffusionExecutor.__init__, {"self", "options"}) == set(RULES[_multiproc][1])
    # ``placement_group`` is a Ray type: checked once Ray is imported (the constructor).
    assert params(RayDiffusionExecutor.__init__, {"self", "options", "placement_group"}) == set(RULES[_ray][1])
