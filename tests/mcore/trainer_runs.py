"""What the trainer tests share: their runs, launched together by ``tests/training/fork_launch.py``, and the comparison."""

from pathlib import Path
from typing import Callable, Dict, List

from megatron.fsdp_training.testing.job import fork_launch


def launch(work: Path, runs: List[dict], read: Callable[[dict, Path, str], dict], parallel: int = 2) -> dict:
    """Run ``runs`` in one launcher, ``parallel`` at a time: each a fork_launch run with a ``name`` (its output folder
    ``work/name`` is its ``LOSSES_DIR``), optionally ``after`` (names of runs that must end first) and ``failing``
    (expected to stop). ``{name: read(spec, folder, log) + log and status}``; a run that fails unexpectedly fails
    the test."""
    names = [run["name"] for run in runs]
    specs, failing = [], []
    for run in runs:
        run = dict(run)
        out = work / run.pop("name")
        out.mkdir()
        failing.append(run.pop("failing", False))
        run["after"] = [names.index(name) for name in run.get("after", [])]
        specs.append({**run, "log": str(out / "log"), "env": {"LOSSES_DIR": str(out)}})
    statuses, logs = fork_launch(specs, work, parallel=parallel, timeout=900)
    results = {}
    for spec, status, log, expected_failure in zip(specs, statuses, logs, failing):
        out = Path(spec["log"]).parent
        assert expected_failure or status == 0, f"{out.name}: {log[-6000:]}"
        results[out.name] = {**read(spec, out, log), "log": log, "status": status}
    return results


def assert_close(a: Dict[int, float], b: Dict[int, float], rel: float, iterations) -> None:
    """``a`` equals ``b`` within ``rel`` at every one of ``iterations`` (each present in both)."""
    for it in iterations:
        assert it in a and it in b, (a, b)
        assert abs(a[it] - b[it]) <= rel * abs(b[it]), f"iteration {it}: {a[it]!r} vs {b[it]!r}"
