"""The benchmark's quick path runs end to end and reports every system with finite numbers.

Behaviour only (no speed): ``tools/bench/run.py --quick`` for the torch workload on 2
ranks must produce a row for every system of that workload with a finite step time,
throughput, memory and collective bytes, theory to compare with, and the JSON file.
"""

import json
import math
import sys

import pytest

from tools.bench import bf16_support, nv_fsdp, report, run
from tools.bench.spec import FLOOR, NV_FSDP, OURS_FP8, OURS_OPTIONS, SIZES, SYSTEMS

ZERO3 = "ours:optim_grads_params"


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
    runnable = [r for r in results["runs"] if r["status"] != "not runnable"]
    assert printed.err.count(": running (") == len(runnable) and "[1/" in printed.err  # progress per run
    assert "plot: skipped: matplotlib is not installed (pip install -e '.[plot]'" in printed.out
    rows = {row["system"]: row for row in results["rows"]}
    expected = [s for s in SYSTEMS["torch"] if s != "unwrapped"]  # world size 1 only
    assert sorted(rows) == sorted(expected)
    if not nv_fsdp.available():  # the optional peer: its row says why it did not run, and how to install it
        for system in NV_FSDP:
            assert rows.pop(system)["not_runnable"] == nv_fsdp.NOT_INSTALLED
            assert "not runnable: megatron-fsdp not installed (pip install -e .[bench])" in printed.out
    every = dict(rows)
    if results["meta"]["dtype"] != "bf16":  # the job refuses --grad-reduce-in-bf16 without --bf16: a row says so
        assert rows.pop(OURS_OPTIONS[0])["not_runnable"] == run.BF16_REDUCE_NEEDS_BF16
        for system in OURS_FP8:  # FP8 gathers replace bf16 gathers: refused without bf16 compute, said in the row
            assert rows.pop(system)["not_runnable"] == run.FP8_GATHER_NEEDS_BF16
    assert rows[FLOOR]["of_floor"] == 1.0 and not rows[FLOOR]["bytes"]  # the floor sends nothing
    # ... and keeps what its recipe says (bf16: the bf16 model besides fp32 main weights and Adam)
    assert abs(rows[FLOOR]["persistent_bytes"] / rows[FLOOR]["persistent_theory"] - 1) < 0.01, rows[FLOOR]
    for system, row in rows.items():
        assert row["rounds_ok"] == 1 and not row["crash_reasons"], row
        numbers = [row["step_s"]["median"], row["tokens_per_s"], row["persistent_bytes"],
                   row["persistent_theory"], row["peak_bytes"], row["wire_bytes"]]
        assert all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers), (system, numbers)
        assert row["step_s"]["median"] > 0 and row["tokens_per_s"] > 0, row
        total = sum(b for axes in row["bytes"].values() for b in axes.values())
        assert row["of_floor"] > 0, row
        if system != FLOOR:
            assert total > 0 and sum(row["bytes_theory"].values()) > 0, row
    # The engine's ledger and the independent counters agree on the collectives it issued.
    zero3 = next(r for r in results["runs"] if r["system"] == "ours:optim_grads_params")["per_rank"][0]
    assert zero3["counted_bytes"]["all_gather"]["world"] == zero3["ledger_bytes"]["all_gather"]["dp_shard"] > 0
    assert rows["ours:optim_grads_params"]["bytes_source"] == "ledger" and rows["fsdp2"]["bytes_source"] != "ledger"
    assert set(rows["ours:no_shard"]["ratios"]) == {"fsdp2"}
    # The job's two flags as engine options: --grad-reduce-in-bf16 halves the
    # reduce-scatter bytes and nothing else; --fsdp-double-buffer keeps its gather buffers,
    # which the persistent theory counts; both meet theory.
    base, bf16_reduce, double = (every[s] for s in ("ours:optim_grads_params",) + OURS_OPTIONS)
    if results["meta"]["dtype"] == "bf16":
        assert bf16_reduce["bytes"]["reduce_scatter"]["dp_shard"] * 2 == base["bytes"]["reduce_scatter"]["dp_shard"]
        assert bf16_reduce["bytes"]["all_gather"] == base["bytes"]["all_gather"]
        assert bf16_reduce["bytes_theory"]["reduce_scatter"] * 2 == base["bytes_theory"]["reduce_scatter"]
    assert double["bytes"] == base["bytes"] and double["persistent_theory"] > base["persistent_theory"]
    for row in (r for r in (bf16_reduce, double) if r["rounds_ok"]):
        got, want = sum(row["bytes"]["reduce_scatter"].values()), row["bytes_theory"]["reduce_scatter"]
        assert abs(got / want - 1) < 0.01 and abs(row["persistent_bytes"] / row["persistent_theory"] - 1) < 0.01, row
    if results["meta"]["dtype"] == "bf16":
        _check_fp8_gather_rows(base, every, results["targets"])
    assert [t["target"] for t in results["targets"]] and all("status" in t for t in results["targets"])


def _check_fp8_gather_rows(base, rows, targets):
    """The FP8 and MXFP8 gather rows (bf16 compute, ZeRO-3, tiny, 2 ranks) against the bf16 row.

    Theory: quantized weights at 1 byte (MXFP8 1 + 1/32), the rest at 2; the measured all-gather exceeds it
    only by the wire's padding: every piece of a unit's wire is as long as its longest, and on tiny the
    blocks' biases and norms (832 elements, 2 bytes each) fall in one piece of two, +832 bytes a gather,
    +1.3% of tiny's FP8 all-gather. Tiny's root (embeddings, final norm: 16% of the model, no nn.Linear)
    stays bf16 in both rows, so the whole step's ratio is 0.5625x (0.576x) in theory; the blocks' alone,
    the root's equal bytes subtracted from both, 0.508x (0.524x)."""
    bf16_gather = sum(base["bytes"]["all_gather"].values())
    norm = sum(base["bytes"]["all_reduce"].values())  # the gradient norm's scalar, which the theory leaves out
    root = 2 * base["root_params"]
    for system, whole, blocks in ((OURS_FP8[0], (0.5625, 0.5725), (0.508, 0.518)),
                                  (OURS_FP8[1], (0.5761, 0.5861), (0.5237, 0.5337))):
        row = rows[system]
        assert row["rounds_ok"] == 1 and row["bytes_source"] == "ledger", row
        got, theory = sum(row["bytes"]["all_gather"].values()), row["bytes_theory"]["all_gather"]
        assert 0 <= got / theory - 1 <= 0.015, (system, got, theory)  # the wire's padding, and only that
        assert theory / base["bytes_theory"]["all_gather"] == pytest.approx(whole[0], abs=1e-4), system
        assert whole[0] <= got / bf16_gather <= whole[1], (system, got / bf16_gather)
        assert blocks[0] <= (got - root) / (bf16_gather - root) <= blocks[1], (system, got, bf16_gather)
        assert row["bytes"]["reduce_scatter"] == base["bytes"]["reduce_scatter"]  # gradients: unchanged
        # The per-tensor recipe's amax all-reduce (fp32, one per weight, batched per unit) is in the ledger
        # and in the theory: 4 weights x 2 blocks x 4 bytes per step; MXFP8 has none.
        amax = row["bytes_theory"].get("all_reduce", 0)
        assert amax == (32 if system == OURS_FP8[0] else 0) and sum(row["bytes"]["all_reduce"].values()) == amax + norm
        assert abs(row["persistent_bytes"] / row["persistent_theory"] - 1) < 0.01, row
    # The targets come from the shape: tiny's minimum (0.508x, 0.524x) plus at most the wire's padding, which
    # on tiny is most of the measured excess: the verdicts hold at --quick's size as at the full shapes.
    for system, minimum in zip(OURS_FP8, ("0.508x", "0.524x")):
        [found] = [t for t in targets if t["target"].startswith(report.LABELS[system] + ":")]
        assert "the shape's minimum" in found["target"] and found["status"] == "pass", found
        assert found["details"][0].startswith("tiny 2 ranks: blocks 0.5") and f"(this shape: {minimum} +" in \
            found["details"][0], found
    assert _by_name(targets, "collective bytes within 1% of theory")["status"] == "pass"


def _fp8_run(system, ranks, all_gather, reduce_scatter):
    """A run record of the torch workload on tiny with the given ledger bytes (what aggregate reads)."""
    per_rank = {"times": [0.1, 0.1, 0.1], "persistent_bytes": 1, "peak_bytes": 1, "params": 118528,
                "root_params": 18560, "last_unit_params": 49984, "tokens_per_step": 256, "quantized_params": 98304,
                "last_unit_quantized": 49152, "quantized_tensors": 8,
                "ledger_bytes": {"all_gather": {"dp_shard": all_gather},
                                 "reduce_scatter": {"dp_shard": reduce_scatter}}}
    return {"workload": "torch", "size": "tiny", "ranks": ranks, "system": system, "dtype": "bf16", "round": 0,
            "status": "ok", "reason": None, "per_rank": [per_rank] * ranks}


def test_fp8_gather_targets_follow_the_shape_and_the_wire_padding():
    """The FP8 gather verdicts at tiny on 4 ranks, from the ledger bytes a --quick run records there: the blocks'
    minimum is 0.508x (0.524x) of bf16's, the wire pads each gather by up to 3 x 832 compute-dtype elements' extra
    byte (+0.026x), and the measured 0.533x (0.551x) passes; a wire carrying bf16 weights (1.0x) or more padding
    than the shape allows fails. The same padding widens the 1% theory target for those rows alone."""
    bf16 = _fp8_run(ZERO3, 4, 337024, 474112)
    fp8, mxfp8 = _fp8_run(OURS_FP8[0], 4, 197056, 474112), _fp8_run(OURS_FP8[1], 4, 202432, 474624)
    rows = report.aggregate([bf16, fp8, mxfp8])
    by = {r["system"]: r for r in rows}
    assert by[OURS_FP8[0]]["wire_padding"] == 3 * (3 * 832 * 1 + 4 * 15) and by[ZERO3]["wire_padding"] == 0
    assert by[OURS_FP8[1]]["wire_padding"] == 3 * (3 * 832 * (2 - 1 - 1 / 32) + 4 * 15)
    targets = report.targets(rows)
    for system, detail in zip(OURS_FP8, ("blocks 0.533x (this shape: 0.508x + wire padding up to 0.026x)",
                                         "blocks 0.551x (this shape: 0.524x + wire padding up to 0.025x)")):
        found = _by_name(targets, report.LABELS[system] + ":")
        assert found["status"] == "pass" and found["details"][0].startswith(f"tiny 4 ranks: {detail}"), found
    assert _by_name(targets, "collective bytes within 1% of theory")["status"] == "pass"
    too_much = 197056 + 2 * 3 * 2496  # each block gather padded twice as much as its shape allows
    for all_gather in (337024, too_much):
        rows = report.aggregate([bf16, _fp8_run(OURS_FP8[0], 4, all_gather, 474112)])
        assert _by_name(report.targets(rows), report.LABELS[OURS_FP8[0]] + ":")["status"] == "fail", all_gather
    assert _by_name(report.targets(rows), "collective bytes within 1% of theory")["status"] == "fail"


def test_fp8_gather_rows_refuse_fp32_and_select_the_blocks_linear_weights():
    """The FP8 gather rows need bf16 compute: one clear ValueError from the case, a "not runnable" row from the
    orchestrator. What they quantize is the engine's default selection on the example model: each block's qkv,
    proj, fc1 and fc2 weights (12 h^2 elements), not the root's embeddings or tied head, norms or biases."""
    from tools.bench import torch_case

    model = torch_case.build_model("tiny")
    for system in OURS_FP8:
        with pytest.raises(ValueError, match=r"gather \(--fp8-param-gather\) needs bf16 compute"):
            torch_case.wrap_ours(model, "optim_grads_params", bf16=False, option=system.partition("+")[2])
        assert run.not_runnable(system, "fp32") == run.FP8_GATHER_NEEDS_BF16 and run.not_runnable(system) is None
        assert system in SYSTEMS["torch"] and system not in SYSTEMS["mcore"]
    h = SIZES["tiny"].hidden
    assert [n for n, p in model.named_parameters() if any(p is w for w in torch_case.linear_weights(model))] == [
        f"blocks.{k}.{m}.weight" for k in range(SIZES["tiny"].layers) for m in ("qkv", "proj", "fc1", "fc2")]
    assert torch_case.quantized_counts(model) == dict(quantized_params=2 * 12 * h * h, last_unit_quantized=12 * h * h,
                                                      quantized_tensors=8)


def test_quick_mcore_floor_is_the_unwrapped_gptmodel_with_no_collectives(tmp_path):
    """The Megatron-Core workload has the floor too: the GPTModel unwrapped on every rank,
    nothing sent, Megatron's bf16 recipe kept (the bf16 model, fp32 main weights, Adam), and every row
    gets its fraction of it."""
    out = tmp_path / "mcore.json"
    run.main(["--quick", "--workloads", "mcore", "--ranks", "2", "--timeout", "120", "--out", str(out), "--plot", "",
              "--systems", "floor", "ours:optim_grads_params", "mcore_ddp"])
    rows = {row["system"]: row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted([FLOOR, "ours:optim_grads_params", "mcore_ddp"]) and FLOOR in SYSTEMS["mcore"]
    floor = rows[FLOOR]
    assert floor["rounds_ok"] == 1 and floor["of_floor"] == 1.0, floor
    assert not floor["bytes"] and not floor["wire_bytes"], floor
    assert abs(floor["persistent_bytes"] / floor["persistent_theory"] - 1) < 0.01, floor
    for system in ("ours:optim_grads_params", "mcore_ddp"):
        assert rows[system]["rounds_ok"] == 1 and 0 < rows[system]["of_floor"] < 10, rows[system]
        assert sum(n for kinds in rows[system]["bytes"].values() for n in kinds.values()) > 0, rows[system]


def _by_name(targets, start):
    return next(t for t in targets if t["target"].startswith(start))


def _row(median, p25, p75, ranks=1, system="ours:no_shard", size="5M"):
    return {"workload": "torch", "size": size, "ranks": ranks, "system": system, "label": system, "rounds_ok": 3,
            "step_s": {"median": median, "p25": p25, "p75": p75}, "bytes": {}, "bytes_theory": {},
            "persistent_bytes": 1.0, "persistent_theory": 1.0, "tokens_per_s": 1.0 / median, "peak_bytes": 1.0}


def test_verdicts_say_noise_when_the_spread_hides_the_effect():
    base = _row(1.0, 0.99, 1.01, system="unwrapped")
    single = lambda ours: _by_name(report.targets([base, ours]), "world size 1")  # noqa: E731  vs unwrapped
    assert single(_row(1.02, 1.01, 1.03))["status"] == "pass"  # +2% +-1.4%: within 5%
    assert single(_row(1.20, 1.19, 1.21))["status"] == "fail"  # +20%
    assert single(_row(1.40, 0.60, 1.80))["status"] == report.NOISE  # +40% at +-43%: [fail] before
    assert single(_row(0.45, 0.10, 0.80))["status"] == report.NOISE  # -55% at +-78%: [pass] before
    assert single(_row(1.05, 1.0, 1.1))["status"] == report.NOISE  # at the threshold itself
    assert "(spread ±" in single(_row(1.02, 1.01, 1.03))["details"][0]
    assert report.resolved(0.5, 0.15, 0.1, True) is True and report.resolved(0.1, 0.15, 0.1, True) is None
    native, reason = bf16_support.native_bf16()
    assert isinstance(native, bool) and reason


def test_floor_targets_every_shape_and_not_runnable_rows(monkeypatch):
    """The ZeRO-3 verdicts use the floor on every shape; an absent optional peer is a row that says so."""
    rows = []
    for size in ("5M", "root-heavy"):
        for n, ours_ms in ((2, 1.05), (4, 1.30)):
            rows += [_row(1.0, 0.995, 1.005, n, FLOOR, size), _row(1.25, 1.245, 1.255, n, "fsdp2", size),
                     _row(ours_ms if size == "5M" else 1.02, 0.0, 0.0, n, "ours:optim_grads_params", size)]
    for r in rows:
        if r["system"] == "ours:optim_grads_params":
            median = r["step_s"]["median"]
            r["step_s"].update(p25=median * 0.995, p75=median * 1.005)
            r.update(bytes={"all_gather": {"world": 1.0}}, bytes_theory={"all_gather": 1.0})
    for r in rows:  # what aggregate adds: the fraction of the floor of the same shape and world size
        floor = next(f for f in rows if f["system"] == FLOOR and (f["size"], f["ranks"]) == (r["size"], r["ranks"]))
        r["of_floor"] = floor["step_s"]["median"] / r["step_s"]["median"]
    targets = report.targets(rows)
    two, four = _by_name(targets, "ours ZeRO-3 on 2 ranks"), _by_name(targets, "ours ZeRO-3 on 4 ranks")
    assert two["status"] == "pass", two  # 0.95 and 0.98 of the floor, 1.19x and 1.23x FSDP2
    assert four["status"] == "fail" and "5M 4 ranks: 0.77 of the floor" in four["details"][0], four
    assert len(four["details"]) == 2 and "root-heavy 4 ranks: 0.98" in four["details"][1]
    one_step = [dict(r, step_s=dict(r["step_s"], n=1)) for r in rows]  # one timed step: its spread is unknown
    assert _by_name(report.targets(one_step), "ours ZeRO-3 on 4 ranks")["status"] == report.NOISE

    monkeypatch.setattr(nv_fsdp, "available", lambda: False)
    assert run.not_runnable(NV_FSDP[0]) == nv_fsdp.NOT_INSTALLED and run.not_runnable(FLOOR) is None
    record = {"workload": "torch", "ranks": 2, "size": "tiny", "system": NV_FSDP[0], "dtype": "fp32", "round": 0,
              "status": "not runnable", "reason": nv_fsdp.NOT_INSTALLED}
    [row] = report.aggregate([record])
    assert row["rounds_ok"] == 0 and row["rounds_crashed"] == 0 and not row["crash_reasons"]
    assert report.format_row(row).endswith("not runnable: megatron-fsdp not installed (pip install -e .[bench])")
    # The shapes beyond 5M/50M exist as docs/performance.md defines them.
    assert SIZES["root-heavy"].vocab >= 8192 and SIZES["root-heavy"].layers <= 4
    assert SIZES["deep-narrow"].layers >= 24 and SIZES["deep-narrow"].hidden <= 256


def test_bf16_support_prints_its_verdict(capsys):
    """``python tools/bench/bf16_support.py`` says native or emulated, why, and the benchmarks' default."""
    native, reason = bf16_support.native_bf16()
    assert bf16_support.main() == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"bf16: {'native' if native else 'emulated'} ({reason})"), printed


def test_zero3_memory_bound_adds_the_floors_activations_to_the_sharded_state():
    """memory_phases' lower bound: persistent theory + what the floor adds up to its first backward mark
    (its activations and loss, not its optimizer step) + the gathered root and largest block in bf16."""
    from tools.bench.memory_phases import MIB, activation_peak, format_bound, zero3_bound
    from tools.bench.spec import theory_persistent

    rows = [("start", 900 * MIB, 900 * MIB), ("fwd> 0", 950 * MIB, 940 * MIB), ("fwd< 0", 1000 * MIB, 990 * MIB),
            ("bwd> 0", 1030 * MIB, 1000 * MIB), ("bwd< 0", 1010 * MIB, 960 * MIB),
            ("optimizer step", 1500 * MIB, 1200 * MIB)]
    assert activation_peak(rows) == 130 * MIB
    sizes = {"params": 10 * 2 ** 20, "root_params": 2 ** 20, "largest_unit": 2 * 2 ** 20}
    bound = zero3_bound(rows, sizes, world=4)
    assert bound["persistent"] == theory_persistent("ours:optim_grads_params", sizes["params"], 4, 2) == 30 * MIB
    assert bound["gathered"] == 6 * MIB
    assert bound["bound"] == 166 * MIB
    text = format_bound(bound, {"floor": 1500 * MIB, "fsdp2": 200 * MIB, "ours:optim_grads_params": 170 * MIB})
    assert "= 166.0 MiB" in text and "ours:optim_grads_params: peak 170.0 MiB, 1.024x the bound" in text
    assert "0.92x FSDP2 = 184.0 MiB: 1.108x the bound" in text and "floor: peak" not in text


def test_memory_verdict_judges_the_jobs_allocator_and_glibcs_defaults_apart():
    from tools.bench.memory import verdict

    def row(ranks, arena, system, ratio):
        return {"ranks": ranks, "arena": arena, "system": system, "peak_x_fsdp2": ratio}
    table = [row(2, "default", "fsdp2", None), row(2, "default", "ours:optim_grads_params", 0.93),
             row(2, "glibc", "ours:optim_grads_params", 0.89), row(4, "glibc", "ours:optim_grads_params", 0.82),
             row(2, "1", "ours:optim_grads_params", 0.5)]
    lines = verdict(table).splitlines()
    assert lines == ["[fail] ZeRO-3 (bf16 compute, fp32 state) peak <= 0.92x FSDP2, allocator default: N=2: 0.930x",
                     "[pass] ZeRO-3 (bf16 compute, fp32 state) peak <= 0.92x FSDP2, allocator glibc: "
                     "N=2: 0.890x, N=4: 0.820x"]
    assert verdict([row(2, "1", "ours:optim_grads_params", 0.5)]).startswith("[not measured]")


def test_gpu_fp8_check_runs_on_cpu_and_fails_on_a_difference(monkeypatch, capsys):
    """gpu_check.sh's FP8 step (tools/bench/gpu_fp8_check.py) on CPU: every recipe and format bitwise, the
    FP8 GEMM against the dequantized product; a quantizer that differs on the checked device is exit status 1."""
    from megatron.fsdp.precision import fp8
    from tools.bench import gpu_fp8_check

    assert gpu_fp8_check.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("bitwise on cpu vs cpu") == 4 and "fp8 _scaled_mm e4m3 64x128x96" in out, out
    original, calls = fp8.quantize_mxfp8, []

    def device_differs(x, fmt):  # each check quantizes on the CPU, then on the device: the second one differs
        calls.append(x)
        return original(x * 2 if len(calls) % 2 == 0 else x, fmt)

    monkeypatch.setattr(fp8, "quantize_mxfp8", device_differs)
    assert gpu_fp8_check.main(["--device", "cpu"]) == 1
    assert "fp8 checks failed: mxfp8/e4m3, mxfp8/e5m2" in capsys.readouterr().out
