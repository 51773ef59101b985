"""tools/profile_schedule.py: a profiled step gives a Chrome trace with the schedule's ranges and a
per-unit table in which every gather and reduction is paired with its wait."""

import json

import pytest

from tools import profile_schedule as ps


def test_profiled_step_on_a_2x2_mesh(pool, tmp_path):
    results = pool.run(ps.profile_case, size=4, timeout=300, model_size="tiny",
                       level="optim_grads_params", outer="optim_grads_params", mesh=(2, 2), bf16=False,
                       overlap={}, steps=ps.ProfiledSteps(train_iters=3, start=1, end=3, out=str(tmp_path)))
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e.get("name") for e in events}
    units = results[0]["units"]
    assert {f"fsdp.wait.reduce {u}" for u in units} <= names and "fsdp.all_gather blocks.1" in names

    rows = ps.per_unit_rows(results[0]["events"])
    ops = {(r["unit"], r["op"], r["phase"]) for r in rows}
    for unit in units:
        assert (unit, "reduce", "backward") in ops and (unit, "install", "step") in ops
        assert (unit, "all_gather", "forward") in ops
    installs = sorted((r for r in rows if r["op"] == "install"), key=lambda r: r["issued"])
    waited = [r for r in rows if r["op"] != "install"] + installs[:len(units)]  # the last step's: in the next
    assert all(r["waited"] is not None and r["waited"] >= 0 and r["landed"] >= r["issued"] for r in waited), rows
    assert all(r["waited"] is None for r in installs[len(units):])
    # ZeRO-3 on both axes: the second stage (inner all-gather, outer reduce-scatter) of every gather
    # and reduction, the first unit of each pass and the last reduction included, is issued at a
    # compute boundary, never inside its wait (docs/mesh.md "What overlaps").
    gathers = [r for r in rows if r["op"] == "all_gather"]
    assert all(r["axes"] == ["all_gather/dp_outer"] and r["staged"] == ["all_gather/dp_shard"] and not r["in_wait"]
               for r in gathers), gathers
    reductions = [r for r in rows if r["op"] == "reduce"]
    assert all(r["axes"] == ["reduce_scatter/dp_shard"] and r["staged"] == ["reduce_scatter/dp_outer"]
               and not r["in_wait"] for r in reductions), reductions
    table = ps.format_timeline(rows, 0)
    assert "blocks.1" in table and "compute waited" in table


def test_arguments_are_checked(capsys):
    for argv, message in ((["--profile-step-start", "3", "--profile-step-end", "3"], "profile-step-start"),
                          (["--ranks", "6", "--outer", "optim", "--outer-size", "4"], "does not divide"),
                          (["--ranks", "8", "--outer", "optim", "--outer-size", "2"], "two-axis meshes")):
        with pytest.raises(SystemExit):
            ps.parse_args(argv)
        assert message in capsys.readouterr().err
