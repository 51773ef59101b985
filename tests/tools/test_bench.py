"""The benchmark's quick path runs end to end and reports every system with finite numbers.

Behaviour only (no speed): ``tools/bench/run.py --quick`` for the torch workload on 2
ranks must produce a row for every system of that workload with a finite step time,
throughput, memory and collective bytes, theory to compare with, and the JSON file.
"""

import json
import math
import sys

from tools.bench import bf16_support, report, run
from tools.bench.spec import SYSTEMS


def test_quick_torch_two_ranks(tmp_path, monkeypatch, capsys):
    out = tmp_path / "results.json"
    written = []  # --out is rewritten after every run (a killed benchmark keeps its rows), whole each time
    write = run.write_json
    monkeypatch.setattr(run, "write_json", lambda path, results: (written.append(json.loads(json.dumps(results))),
                                                                   write(path, results)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # absent: said, not silently skipped
    run.main(["--quick", "--workloads", "torch", "--ranks", "2", "--timeout", "120", "--out", str(out),
              "--plot", str(tmp_path / "plot.png")])
    results = json.loads(out.read_text())
    assert [len(w["runs"]) for w in written] == list(range(1, len(results["runs"]) + 1)) + [len(results["runs"])]
    assert [w["meta"]["complete"] for w in written] == [False] * len(results["runs"]) + [True]
    printed = capsys.readouterr()
    native = bf16_support.native_bf16()[0]
    assert results["meta"]["dtype"] == ("bf16" if native else "fp32")
    assert f"dtype: {results['meta']['dtype']} (" in printed.err
    assert printed.err.count(": running (") == len(results["runs"]) and "[1/" in printed.err  # progress per run
    assert "plot: skipped: matplotlib is not installed (pip install -e '.[plot]'" in printed.out
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


def _row(median, p25, p75, ranks=1, system="ours:no_shard"):
    return {"workload": "torch", "size": "5M", "ranks": ranks, "system": system, "label": system, "rounds_ok": 3,
            "step_s": {"median": median, "p25": p25, "p75": p75}, "bytes": {}, "bytes_theory": {},
            "persistent_bytes": 1.0, "persistent_theory": 1.0, "tokens_per_s": 1.0 / median, "peak_bytes": 1.0}


def test_verdicts_say_noise_when_the_spread_hides_the_effect():
    base = _row(1.0, 0.99, 1.01, system="unwrapped")
    single = lambda ours: report.targets([base, ours])[3]  # noqa: E731  world size 1 vs the unwrapped model
    assert single(_row(1.02, 1.01, 1.03))["status"] == "pass"  # +2% +-1.4%: within 5%
    assert single(_row(1.20, 1.19, 1.21))["status"] == "fail"  # +20%
    assert single(_row(1.40, 0.60, 1.80))["status"] == report.NOISE  # +40% at +-43%: [fail] before
    assert single(_row(0.45, 0.10, 0.80))["status"] == report.NOISE  # -55% at +-78%: [pass] before
    assert single(_row(1.05, 1.0, 1.1))["status"] == report.NOISE  # at the threshold itself
    assert "(spread ±" in single(_row(1.02, 1.01, 1.03))["details"][0]
    assert report.resolved(0.5, 0.15, 0.1, True) is True and report.resolved(0.1, 0.15, 0.1, True) is None
    native, reason = bf16_support.native_bf16()
    assert isinstance(native, bool) and reason


def test_bf16_support_prints_its_verdict(capsys):
    """``python tools/bench/bf16_support.py`` says native or emulated, why, and the benchmarks' default (issue 27)."""
    native, reason = bf16_support.native_bf16()
    assert bf16_support.main() == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"bf16: {'native' if native else 'emulated'} ({reason})"), printed
