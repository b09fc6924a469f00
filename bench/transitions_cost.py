"""What would it cost to run the request machine on ``transitions`` instead of the table core?

DESIGN.md section 3 asks to choose between building the runtime machines with
``transitions`` and using ``transitions`` only as a test oracle "by a measured number".
This script measures, on the same table (``omni_async.core.states.REQUEST_TABLE``):

* per-trigger cost: ``Machine.fire`` vs ``transitions`` (``model.trigger(name)`` and the
  generated ``model.NAME()`` method) on a self-loop, so no construction is included;
* construction cost: the registry creates one machine per output id, so we time
  ``request_machine(id)`` vs a new ``transitions.Machine`` per request, and vs one shared
  ``transitions.Machine`` with ``add_model``/``remove_model`` per request (the cheapest
  way to use ``transitions`` with many objects);
* one request's whole life on the executor side (create + COMPUTE_DONE + OUTPUT_READY +
  DELIVER) in each of those three ways.

Usage: ``python bench/transitions_cost.py [--repeat N] [--number N] [--out PATH]``.
Prints a table and writes JSON (numbers in nanoseconds per operation; the minimum over
``repeat`` runs of ``number`` operations each, as ``timeit`` recommends) with the command
line, Python and ``transitions`` versions and machine information.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transitions

from omni_async.core.states import (
    REGISTRY_INITIAL,
    REQUEST_TABLE,
    RequestEvent,
    RequestState,
    request_machine,
)

S = RequestState
E = RequestEvent

STATES = [s.name for s in RequestState]
TRANSITIONS = [{"trigger": ev.name, "source": src.name, "dest": dst.name} for (src, ev), dst in REQUEST_TABLE.items()]
# The executor-side life of one output: created in COMPUTING by the registry.
LIFE = [E.COMPUTE_DONE, E.OUTPUT_READY, E.DELIVER]
LIFE_NAMES = [e.name for e in LIFE]


class Model:
    """A bare model object for ``transitions`` (it attaches ``state`` and the triggers)."""

    state: str


def trigger_of(model: Model) -> Callable[[str], bool]:
    """The ``trigger`` method ``transitions`` attached to ``model``."""
    fn: Callable[[str], bool] = model.trigger
    return fn


def new_transitions_machine(model: object, initial: str) -> transitions.Machine:
    return transitions.Machine(
        model=model,
        states=STATES,
        transitions=TRANSITIONS,
        initial=initial,
        ignore_invalid_triggers=False,
        auto_transitions=False,
    )


def measure(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Nanoseconds per call: min over ``repeat`` runs of ``number`` calls."""
    times = timeit.Timer(fn).repeat(repeat=repeat, number=number)
    return min(times) / number * 1e9


def run(number: int, repeat: int) -> dict[str, Any]:
    results: dict[str, float] = {}

    # -- per trigger (self-loop DROPPING --DROP--> DROPPING) ---------------------------
    core = request_machine("bench", S.DROPPING)
    results["trigger.table_core.fire"] = measure(lambda: core.fire(E.DROP), number, repeat)
    assert core.state is S.DROPPING

    tmodel = Model()
    new_transitions_machine(tmodel, S.DROPPING.name)
    ttrigger = trigger_of(tmodel)
    results["trigger.transitions.model_trigger"] = measure(lambda: ttrigger("DROP"), number, repeat)
    drop_method: Callable[[], bool] = tmodel.DROP
    results["trigger.transitions.model_method"] = measure(drop_method, number, repeat)
    assert tmodel.state == "DROPPING"

    # -- construction, one machine per output id ----------------------------------------
    cnumber = max(1, number // 100)
    results["construct.table_core.request_machine"] = measure(
        lambda: request_machine("o", REGISTRY_INITIAL), number, repeat
    )
    results["construct.transitions.new_machine"] = measure(
        lambda: new_transitions_machine(Model(), REGISTRY_INITIAL.name), cnumber, repeat
    )
    shared = transitions.Machine(
        model=None,
        states=STATES,
        transitions=TRANSITIONS,
        initial=REGISTRY_INITIAL.name,
        ignore_invalid_triggers=False,
        auto_transitions=False,
    )

    def add_remove() -> None:
        m = Model()
        shared.add_model(m)
        shared.remove_model(m)

    results["construct.transitions.shared_add_remove_model"] = measure(add_remove, max(1, number // 50), repeat)

    # -- one output's executor-side life: create + COMPUTE_DONE + OUTPUT_READY + DELIVER --
    def life_core() -> None:
        m = request_machine("o", REGISTRY_INITIAL)
        for ev in LIFE:
            m.fire(ev)

    def life_new_machine() -> None:
        m = Model()
        new_transitions_machine(m, REGISTRY_INITIAL.name)
        trig = trigger_of(m)
        for name in LIFE_NAMES:
            trig(name)

    def life_shared() -> None:
        m = Model()
        shared.add_model(m)
        trig = trigger_of(m)
        for name in LIFE_NAMES:
            trig(name)
        shared.remove_model(m)

    results["life.table_core"] = measure(life_core, number // 4, repeat)
    results["life.transitions.new_machine"] = measure(life_new_machine, cnumber, repeat)
    results["life.transitions.shared_machine"] = measure(life_shared, max(1, number // 50), repeat)

    base_trigger = results["trigger.table_core.fire"]
    base_life = results["life.table_core"]
    ratios = {
        "trigger.transitions.model_trigger / table_core": results["trigger.transitions.model_trigger"] / base_trigger,
        "trigger.transitions.model_method / table_core": results["trigger.transitions.model_method"] / base_trigger,
        "construct.transitions.new_machine / table_core": results["construct.transitions.new_machine"]
        / results["construct.table_core.request_machine"],
        "construct.transitions.shared_add_remove_model / table_core": results[
            "construct.transitions.shared_add_remove_model"
        ]
        / results["construct.table_core.request_machine"],
        "life.transitions.new_machine / table_core": results["life.transitions.new_machine"] / base_life,
        "life.transitions.shared_machine / table_core": results["life.transitions.shared_machine"] / base_life,
    }
    return {"ns_per_op": results, "ratios": ratios}


def machine_info() -> dict[str, Any]:
    return {
        "python": sys.version,
        "implementation": platform.python_implementation(),
        "transitions": transitions.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--number", type=int, default=100_000, help="operations per timing run (triggers)")
    parser.add_argument("--repeat", type=int, default=5, help="timing runs; the minimum is reported")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "transitions_cost.json"
    )
    args = parser.parse_args(argv)

    data = run(args.number, args.repeat)
    report = {
        "benchmark": "transitions_cost",
        "command": [sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv],
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "number": args.number,
        "repeat": args.repeat,
        "unit": "ns per operation (min over repeats)",
        "info": machine_info(),
        **data,
    }

    width = max(len(k) for k in report["ns_per_op"])
    print(f"{'operation':<{width}}  {'ns/op':>12}")
    for name, ns in report["ns_per_op"].items():
        print(f"{name:<{width}}  {ns:>12.1f}")
    print()
    rwidth = max(len(k) for k in report["ratios"])
    for name, ratio in report["ratios"].items():
        print(f"{name:<{rwidth}}  {ratio:>8.1f}x")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
