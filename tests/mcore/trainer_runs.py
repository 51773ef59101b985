"""What the trainer tests share: their runs, launched once by ``tests/training/fork_launch.py``, and the comparison."""

from pathlib import Path
from typing import Callable, Dict, List

from megatron.fsdp_training.testing.job import fork_launch


def launch(work: Path, runs: List[dict], read: Callable[[dict, Path, str], dict], failing: bool = False) -> dict:
    """Run ``runs`` (each a fork_launch run with a ``name``; its output folder ``work/name`` is its ``LOSSES_DIR``)
    one after the other: ``{name: read(spec, folder, log) + log and status}``. A run that fails fails the test unless
    ``failing`` (runs expected to stop)."""
    specs = []
    for run in runs:
        out = work / run.pop("name")
        out.mkdir()
        specs.append({**run, "log": str(out / "log"), "env": {"LOSSES_DIR": str(out)}})
    statuses, logs = fork_launch(specs, work, timeout=900)
    results = {}
    for spec, status, log in zip(specs, statuses, logs):
        out = Path(spec["log"]).parent
        assert failing or status == 0, f"{out.name}: {log[-6000:]}"
        results[out.name] = {**read(spec, out, log), "log": log, "status": status}
    return results


def assert_close(a: Dict[int, float], b: Dict[int, float], rel: float, iterations) -> None:
    """``a`` equals ``b`` within ``rel`` at every one of ``iterations`` (each present in both)."""
    for it in iterations:
        assert it in a and it in b, (a, b)
        assert abs(a[it] - b[it]) <= rel * abs(b[it]), f"iteration {it}: {a[it]!r} vs {b[it]!r}"
