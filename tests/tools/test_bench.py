"""The benchmark's quick path runs end to end and reports every system with finite numbers.

Behaviour only (no speed): ``tools/bench/run.py --quick`` for the torch workload on 2
ranks must produce a row for every system of that workload with a finite step time,
throughput, memory and collective bytes, theory to compare with, and the JSON file.
"""

import json
import math

from tools.bench import run
from tools.bench.spec import SYSTEMS


def test_quick_torch_two_ranks(tmp_path):
    out = tmp_path / "results.json"
    run.main(["--quick", "--workloads", "torch", "--ranks", "2", "--timeout", "120", "--out", str(out)])
    results = json.loads(out.read_text())
    rows = {row["system"]: row for row in results["rows"]}
    expected = [s for s in SYSTEMS["torch"] if s != "unwrapped"]  # world size 1 only
    assert sorted(rows) == sorted(expected)
    for system, row in rows.items():
        assert row["rounds_ok"] == 1 and not row["crash_reasons"], row
        numbers = [row["step_s"]["median"], row["tokens_per_s"], row["persistent_bytes"],
                   row["persistent_theory"], row["peak_bytes"], row["wire_bytes"]]
        assert all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers), (system, numbers)
        assert row["step_s"]["median"] > 0 and row["tokens_per_s"] > 0, row
        total = sum(b for axes in row["bytes"].values() for b in axes.values())
        assert total > 0 and sum(row["bytes_theory"].values()) > 0, row
    # The engine's ledger and the independent counters agree on the collectives it issued.
    zero3 = next(r for r in results["runs"] if r["system"] == "ours:optim_grads_params")["per_rank"][0]
    assert zero3["counted_bytes"]["all_gather"]["world"] == zero3["ledger_bytes"]["all_gather"]["dp_shard"] > 0
    assert rows["ours:optim_grads_params"]["bytes_source"] == "ledger" and rows["fsdp2"]["bytes_source"] != "ledger"
    assert set(rows["ours:no_shard"]["ratios"]) == {"fsdp2"}
    assert [t["target"] for t in results["targets"]] and all("status" in t for t in results["targets"])
