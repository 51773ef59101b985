"""The test suite's budget: tests and seconds per test module, and the whole run against the 12-minute budget.

    python tools/test_budget.py                                 # tests collected per module (pytest --collect-only)
    python tools/test_budget.py --run tests/docs                # run pytest --durations=0 -q there: seconds too
    python tools/test_budget.py --durations ci.log              # seconds from a saved run (--durations=0 for
                                                                # each module's; pytest's closing line: the total)
    python tools/test_budget.py --junit report.xml              # seconds from pytest --junitxml=report.xml

Counts come from ``pytest --collect-only -q`` over the same arguments (the tests a run of them would execute,
after this suite's own deselection), run by this interpreter in the current directory. Seconds per module add up
setup, call and teardown of its tests, so a session fixture (a worker pool starting) counts in the module of the
first test that needs it; the total is the run's wall clock where the source says it (pytest's closing line "N
passed in S s", or the ``--run`` itself), else the sum of the modules. The budget (docs/testing.md): each
environment's ``python -m pytest -q tests`` under 12 minutes on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional, Sequence, Tuple

BUDGET_S = 12 * 60
_DURATION = re.compile(r"^\s*([0-9.]+)s\s+(?:setup|call|teardown)\s+(\S+?\.py)::", re.M)
_CLOSING = re.compile(r"^=*\s*(.*?\b(?:passed|failed|error|errors|skipped|deselected)\b.*?) in ([0-9.]+)s\b", re.M)
_NODE = re.compile(r"^(\S+?\.py)::", re.M)


def counts(pytest_args: Sequence[str], python: str = sys.executable) -> Dict[str, int]:
    """Tests collected per module: ``pytest --collect-only -q`` over ``pytest_args``."""
    out = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", *pytest_args],
                         capture_output=True, text=True)
    if out.returncode not in (0, 5):  # 5: nothing collected
        raise SystemExit(f"pytest --collect-only exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return dict(collections.Counter(_NODE.findall(out.stdout)))


def durations_from_text(text: str) -> Tuple[Dict[str, float], Optional[float], str]:
    """Seconds per module from pytest's ``--durations=0`` report, the wall clock and the closing line."""
    seconds: Dict[str, float] = collections.defaultdict(float)
    for value, module in _DURATION.findall(text):
        seconds[module] += float(value)
    closing = _CLOSING.findall(text)
    return dict(seconds), (float(closing[-1][1]) if closing else None), (closing[-1][0] if closing else "")


def durations_from_junit(path: str, root: str = ".") -> Tuple[Dict[str, float], Optional[float], str]:
    """Seconds per module from ``pytest --junitxml`` (each testcase's time: setup, call and teardown)."""
    tree = ET.parse(path).getroot()
    seconds: Dict[str, float] = collections.defaultdict(float)
    for case in tree.iter("testcase"):
        seconds[_module_of(case.get("classname", ""), case.get("file"), root)] += float(case.get("time", 0) or 0)
    suites = [tree] if tree.tag == "testsuite" else list(tree.iter("testsuite"))
    wall = sum(float(s.get("time", 0) or 0) for s in suites) if suites else None
    return dict(seconds), wall, ""


def _module_of(classname: str, file: Optional[str], root: str) -> str:
    """``tests.tools.test_x`` (or ``tests.tools.test_x.TestCase``) -> ``tests/tools/test_x.py``."""
    if file:
        return file
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        candidate = "/".join(parts[:k]) + ".py"
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return "/".join(parts) + ".py"


def run(pytest_args: Sequence[str], python: str = sys.executable) -> Tuple[Dict[str, float], float, str, int]:
    """Run ``pytest --durations=0 -q`` over ``pytest_args``; its output passes through."""
    start = time.monotonic()
    proc = subprocess.run([python, "-m", "pytest", "--durations=0", "-q", *pytest_args],
                          capture_output=True, text=True)
    wall = time.monotonic() - start
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-2000:])
    seconds, _, closing = durations_from_text(proc.stdout)
    return seconds, wall, closing, proc.returncode


def table(tests: Dict[str, int], seconds: Optional[Dict[str, float]], wall: Optional[float],
          budget_s: float = BUDGET_S) -> str:
    """One line per module (slowest first when timed, else by path), then the total against the budget."""
    modules = sorted(set(tests) | set(seconds or {}))
    if seconds is not None:
        modules.sort(key=lambda m: -seconds.get(m, 0.0))
    width = max([len("module")] + [len(m) for m in modules])
    lines = [f"{'module':<{width}} {'tests':>6} {'seconds':>8} {'share':>6}", "-" * (width + 23)]
    timed = sum(seconds.values()) if seconds else 0.0
    for m in modules:
        if seconds is None:
            lines.append(f"{m:<{width}} {tests.get(m, 0):>6} {'-':>8} {'-':>6}")
        else:
            s = seconds.get(m, 0.0)
            lines.append(f"{m:<{width}} {tests.get(m, 0):>6} {s:>8.1f} {s / timed if timed else 0:>6.1%}")
    lines.append("-" * (width + 23))
    total = wall if wall is not None else (timed if seconds else None)
    lines.append(f"{'total':<{width}} {sum(tests.values()):>6} {'-' if total is None else f'{total:.1f}':>8}")
    if total is not None:
        verdict = "within" if total <= budget_s else "OVER"
        lines.append(f"budget: {total:.0f} s of {budget_s:.0f} s ({total / budget_s:.0%}): {verdict} the budget"
                     + ("" if wall is not None else " (sum of the modules: no wall clock in the source)"))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                epilog="Arguments after the options go to pytest (default: tests).")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--run", action="store_true", help="run pytest --durations=0 -q over the arguments")
    source.add_argument("--durations", metavar="FILE", help="a saved pytest output that had --durations=0")
    source.add_argument("--junit", metavar="FILE", help="a pytest --junitxml file")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"the budget in seconds (default {BUDGET_S})")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest (default: this one)")
    args, pytest_args = p.parse_known_args(argv)
    pytest_args = pytest_args or ["tests"]
    seconds, wall, closing, status = None, None, "", 0
    if args.run:
        seconds, wall, closing, status = run(pytest_args, args.python)
    elif args.durations:
        with open(args.durations, errors="replace") as f:
            seconds, wall, closing = durations_from_text(f.read())
    elif args.junit:
        seconds, wall, closing = durations_from_junit(args.junit)
    tests = counts(pytest_args, args.python)
    if seconds is not None and not seconds:  # e.g. .ci/run's log: pytest's closing line gives the total alone
        print("no per-test durations in the source (pytest --durations=0 prints them): the total only",
              file=sys.stderr)
        seconds = None
    print(table(tests, seconds, wall, args.budget_s))
    if closing:
        print(f"pytest: {closing}")
    return status


if __name__ == "__main__":
    sys.exit(main())
