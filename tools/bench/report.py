"""Turn raw benchmark runs into rows, the printed table and the targets verdict (the PNG: plot.py).

Pure functions of the run records (no process group, no timing), so the orchestrator, the
JSON file and the test agree on every number, and a saved JSON can be re-reported.
"""

from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional

from megatron.fsdp.sharding.quantized_gather import WIRE_ALIGN
from tools.bench.spec import (ENGINE_ROWS, FLOOR, HOLDS_LAST_UNIT, LABELS, OURS_FP8, PEERS, ParamCounts,
                              gather_recipe_of, reduce_bytes_of, theory_bytes, theory_persistent)
from tools.fsdp_planner import QUANTIZED_GATHER_BYTES

MIB = 1024 * 1024
GLOO_WIRE = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2, "broadcast": 1}  # passes of (N-1)/N


def _quantile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _per_kind(table: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    return {kind: sum(axes.values()) for kind, axes in table.items()}


def wire_estimate(counted: Dict[str, Dict[str, float]], world: int) -> float:
    """Bytes one rank sends per step on gloo, from the logical bytes of each collective kind.

    Ring algorithms send ``(N-1)/N`` of the buffer per pass: one pass for an all-gather,
    two for an all-reduce, and two for gloo's reduce-scatter (an all-reduce inside).
    Point-to-point sends count as sent.
    """
    frac = (world - 1) / world
    return sum(b if kind == "send" else GLOO_WIRE.get(kind, 1) * frac * b for kind, b in _per_kind(counted).items())


def aggregate(runs: List[dict]) -> List[dict]:
    """One row per (workload, size, ranks, system): medians over rounds, theory, ratios to peers."""
    groups: Dict[tuple, List[dict]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["size"], run["ranks"], run["system"]), []).append(run)
    rows = []
    for (workload, size, ranks, system), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        row = {"workload": workload, "size": size, "ranks": ranks, "system": system, "label": LABELS[system],
               "dtype": rs[0]["dtype"], "rounds_ok": len(ok),
               "rounds_crashed": sum(r["status"] == "crashed" for r in rs),
               "crash_reasons": sorted({r["reason"] for r in rs if r["status"] == "crashed"}),
               "not_runnable": next((r["reason"] for r in rs if r["status"] == "not runnable"), None)}
        rows.append(row)
        if not ok:
            continue
        sample = ok[-1]["per_rank"][0]  # figures that do not vary between rounds: the last round, rank 0
        steps = [max(ts) for r in ok for ts in zip(*(p["times"] for p in r["per_rank"]))]
        median = statistics.median(steps)
        cpu_total, cpu_sys = _cpu_per_step(ok)
        compute_bytes = 2 if row["dtype"] == "bf16" else 4
        params, root = sample["params"], sample["root_params"]
        ours = system in ENGINE_ROWS
        source = "ledger_bytes" if ours else "counted_bytes"
        collectives = {k: v for k, v in sample.get(source, {}).items() if k in GLOO_WIRE or k == "send"}
        if ours and "wire_bytes" in sample:
            wire, wire_source = sum(_per_kind(sample["wire_bytes"]).values()), "ledger"
        else:
            wire, wire_source = wire_estimate(collectives, ranks) if ranks > 1 else 0.0, "estimate"
        row.update(
            params=params, root_params=root, tokens_per_step=sample["tokens_per_step"],
            step_s={"median": median, "p25": _quantile(steps, 0.25), "p75": _quantile(steps, 0.75),
                    "n": len(steps)},
            tokens_per_s=sample["tokens_per_step"] / median,
            cpu_s=cpu_total, cpu_sys_s=cpu_sys,
            persistent_bytes=statistics.median(max(p["persistent_bytes"] for p in r["per_rank"]) for r in ok),
            persistent_theory=theory_persistent(system, params, ranks, compute_bytes,
                                                sample.get("gather_buffer_params", 0)),
            own_persistent_bytes=sample.get("own_persistent_bytes"),
            peak_bytes=_median_or_none([_max_or_none(p["peak_bytes"] for p in r["per_rank"]) for r in ok]),
            bytes=collectives, bytes_source="ledger" if ours else "torch.distributed counter",
            bytes_theory=theory_bytes(system, ParamCounts(
                params, root, sample.get("last_unit_params", 0),  # absent from runs before it was held
                **{key: sample.get(key, 0) for key in QUANTIZED_KEYS}), ranks, compute_bytes, reduce_bytes_of(system)),
            wire_padding=fp8_wire_padding(system, ranks, compute_bytes, sample),
            wire_bytes=wire, wire_source=wire_source,
        )
    by_group: Dict[tuple, Dict[str, dict]] = {}
    for row in rows:
        by_group.setdefault((row["workload"], row["size"], row["ranks"]), {})[row["system"]] = row
    for row in rows:
        peers = by_group[(row["workload"], row["size"], row["ranks"])]
        row["ratios"] = {}
        for peer in PEERS[row["workload"]]:
            other = peers.get(peer)
            if other is None or peer == row["system"] or "tokens_per_s" not in row:
                continue
            # None: the peer crashed in every round, so there is nothing to compare with
            row["ratios"][peer] = row["tokens_per_s"] / other["tokens_per_s"] if "tokens_per_s" in other else None
        floor = peers.get(FLOOR)
        # The fraction of the no-communication limit this system reaches (floor's step time / this one's).
        row["of_floor"] = (floor["step_s"]["median"] / row["step_s"]["median"]
                           if floor is not None and "step_s" in floor and "step_s" in row else None)
    return rows


def _cpu_per_step(ok: List[dict]):
    """(user + system, system) CPU seconds per step of the busiest rank, medians over every timed step;
    (None, None) for runs saved before the benchmark measured CPU time."""
    total, kernel = [], []
    for r in ok:
        ranks = r["per_rank"]
        if any("cpu_user" not in p for p in ranks):
            return None, None
        for step in range(len(ranks[0]["cpu_user"])):
            total.append(max(p["cpu_user"][step] + p["cpu_sys"][step] for p in ranks))
            kernel.append(max(p["cpu_sys"][step] for p in ranks))
    return (statistics.median(total), statistics.median(kernel)) if total else (None, None)


def _max_or_none(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def _median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _rel(got: Optional[float], want: Optional[float]) -> Optional[float]:
    return None if got is None or not want else got / want - 1


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.2%}"


def _mib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


SHORT = {"fsdp2": "FSDP2", "unwrapped": "unwrapped", "mcore_ddp": "DDP", "mcore_distopt": "DistOpt",
         "mfsdp_v1": "v1"}


def header(workload: str) -> str:
    peers = "".join(f" {'x ' + SHORT[p]:>11}" for p in PEERS[workload])
    return (f"{'workload':<8} {'size':<11} {'N':>2} {'system':<24} | {'step ms':>8} {'spread':>7} | "
            f"{'cpu ms':>7} {'sys':>5} | {'tok/s':>8} |"
            f"{peers} {'of floor':>8} | {'persist MiB':>11} {'vs th':>7} | {'peak MiB':>8} | {'AG MB':>7} {'RS MB':>7} "
            f"{'AR MB':>7} {'vs th':>7} | {'wire MB':>7}")


def format_row(row: dict) -> str:
    head = f"{row['workload']:<8} {row['size']:<11} {row['ranks']:>2} {row['label']:<24} | "
    if row.get("not_runnable"):
        return head + f"not runnable: {row['not_runnable']}"
    if not row["rounds_ok"]:
        return head + f"crashed ({'; '.join(row['crash_reasons'])})"
    step = row["step_s"]
    ratios = ""
    for peer in PEERS[row["workload"]]:
        value = row["ratios"].get(peer, "-")
        ratios += f" {'-' if value == '-' else 'crashed' if value is None else f'{value:.2f}x':>11}"
    ratios += f" {'-' if row.get('of_floor') is None else format(row['of_floor'], '.2f'):>8}"
    kinds = _per_kind(row["bytes"])
    total, theory = sum(kinds.values()), sum(row["bytes_theory"].values())
    mb = lambda kind: f"{kinds.get(kind, 0) / 1e6:>7.2f}"  # noqa: E731
    cpu = "-" if row.get("cpu_s") is None else f"{row['cpu_s'] * 1e3:.1f}"
    kernel = "-" if row.get("cpu_sys_s") is None else f"{row['cpu_sys_s'] * 1e3:.0f}"
    text = (head + f"{step['median'] * 1e3:>8.1f} {f'±{spread(row):.0%}':>7} | {cpu:>7} {kernel:>5} | "
            f"{row['tokens_per_s']:>8.0f} |{ratios} | "
            f"{_mib(row['persistent_bytes']):>11} "
            f"{_pct(_rel(row['persistent_bytes'], row['persistent_theory'])):>7} | {_mib(row['peak_bytes']):>8} | "
            f"{mb('all_gather')} {mb('reduce_scatter')} {mb('all_reduce')} "
            f"{_pct(_rel(total, theory)) if theory else '-':>7} | {row['wire_bytes'] / 1e6:>7.2f}")
    if row["rounds_crashed"]:
        text += f"  [crashed {row['rounds_crashed']}/{row['rounds_crashed'] + row['rounds_ok']}: " \
                f"{'; '.join(row['crash_reasons'])}]"
    return text


def format_table(rows: List[dict]) -> str:
    """One block per workload (its own peer columns)."""
    blocks = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        top = header(workload)
        blocks.append("\n".join([top, "-" * len(top)] + [format_row(r) for r in rows if r["workload"] == workload]))
    return "\n\n".join(blocks)


def targets(rows: List[dict]) -> List[dict]:
    """The targets (docs/performance.md), each with a verdict ("pass", "fail" or "not measured") and its numbers."""
    def find(workload, size, ranks, system):
        return next((r for r in rows if (r["workload"], r["size"], r["ranks"], r["system"])
                     == (workload, size, ranks, system) and r["rounds_ok"]), None)

    out = []
    sizes = list(dict.fromkeys(r["size"] for r in rows if r["workload"] == "torch"))
    for n, of_floor, vs_fsdp2 in ((2, 0.90, 1.15), (4, 0.85, None)):
        details, verdicts = [], []
        for size in sizes:
            ours, floor = find("torch", size, n, ZERO3), find("torch", size, n, FLOOR)
            fsdp2 = find("torch", size, n, "fsdp2")
            if not (ours and floor and (fsdp2 or vs_fsdp2 is None)):
                continue
            fraction, noise = ours["of_floor"], ratio_spread(ours, floor)
            size_verdicts = [resolved(fraction - 1, of_floor - 1, noise, fraction >= of_floor)]
            text = f"{size} {n} ranks: {fraction:.2f} of the floor (spread ±{noise:.0%})"
            if vs_fsdp2 is not None:
                speed, speed_noise = ours["tokens_per_s"] / fsdp2["tokens_per_s"], ratio_spread(ours, fsdp2)
                size_verdicts.append(resolved(speed - 1, vs_fsdp2 - 1, speed_noise, speed >= vs_fsdp2))
                text += f", {speed:.2f}x FSDP2 (spread ±{speed_noise:.0%})"
            verdicts.append(False if False in size_verdicts else None if None in size_verdicts else True)
            details.append(text)
        name = f"ours ZeRO-3 on {n} ranks >= {of_floor:.2f} of the floor" + (
            f" and >= {vs_fsdp2:.2f}x FSDP2 tokens/s" if vs_fsdp2 else "") + ", every shape"
        out.append(_target(name, verdicts, details))
    details, verdicts = [], []
    for size in sizes:
        for n in (2, 4):
            ours, fsdp2 = find("torch", size, n, ZERO3), find("torch", size, n, "fsdp2")
            if ours and fsdp2 and None not in (ours["peak_bytes"], fsdp2["peak_bytes"]):
                verdicts.append(ours["peak_bytes"] <= fsdp2["peak_bytes"])
                details.append(f"{size} {n} ranks: peak {_mib(ours['peak_bytes'])} vs {_mib(fsdp2['peak_bytes'])} MiB")
    out.append(_target("ours ZeRO-3 peak memory <= FSDP2's, every shape", verdicts, details))
    out.extend(fp8_gather_targets(rows, find))
    ours_rows = [r for r in rows if r["system"] in ENGINE_ROWS and r["rounds_ok"]]
    comm = [(r, _rel(sum(_per_kind(r["bytes"]).values()), sum(r["bytes_theory"].values())),
             r.get("wire_padding", 0.0) / sum(r["bytes_theory"].values()))
            for r in ours_rows if r["ranks"] > 1]
    out.append(_target("collective bytes within 1% of theory (ours; FP8 gather rows: + their wire's padding)",
                       [-0.01 <= e <= 0.01 + pad for _, e, pad in comm],
                       [f"{_name(r)}: {_pct(e)}" + (f" (wire padding up to {_pct(pad)})" if pad else "")
                        for r, e, pad in comm]))
    mem = [(r, _rel(r["persistent_bytes"], r["persistent_theory"])) for r in ours_rows]
    out.append(_target("persistent memory within 1% of theory (ours)", [abs(e) <= 0.01 for _, e in mem],
                       [f"{_name(r)}: {_pct(e)}" for r, e in mem]))
    single = []
    for r in ours_rows:
        base = find(r["workload"], r["size"], 1, "unwrapped") if r["ranks"] == 1 else None
        if base:
            single.append((r, r["step_s"]["median"] / base["step_s"]["median"] - 1, ratio_spread(r, base)))
    out.append(_target("world size 1: ours within 5% of the unwrapped model's step time",
                       [resolved(e, 0.05, noise, e <= 0.05) for _, e, noise in single],
                       [f"{_name(r)}: {_pct(e)} (spread ±{noise:.0%})" for r, e, noise in single]))
    return out


NOISE = "noise: not resolvable"
ZERO3 = "ours:optim_grads_params"
QUANTIZED_KEYS = ("quantized_params", "last_unit_quantized", "quantized_tensors")  # torch_case.quantized_counts
# The FP8 gather rows' target, derived from the shape: the all-gather bytes of the blocks (every unit but the
# root) as a fraction of the bf16 ZeRO-3 row's in the same run are theory_bytes' minimum for the shape (1 byte per
# FP8 weight, MXFP8 + 1/32 for its block scales, 2 per bias and norm: 0.508x and 0.524x on tiny, about 0.50x and
# 0.52x on blocks whose weights dwarf their biases and norms) plus at most the wire's padding
# (fp8_wire_padding), within FP8_GATHER_TOLERANCE. The root (embeddings, final norm, the tied head) has no
# nn.Linear weight and is gathered in bf16 by both rows: the same bytes, subtracted from both.
FP8_GATHER_TOLERANCE = 0.01


def fp8_wire_padding(system: str, ranks: int, compute_bytes: int, sample: dict) -> float:
    """The most bytes per step an FP8 gather row's wire adds to ``theory_bytes``' minimum, from the shape (0 for
    every other row).

    The wire (``megatron/fsdp/sharding/quantized_gather.py``) cuts a unit's buffer into one piece per rank and
    sends every piece as long as the longest, rounded up to ``WIRE_ALIGN`` bytes; a piece grows by
    ``compute_bytes - QUANTIZED_GATHER_BYTES[recipe]`` bytes for each element it sends in the compute dtype (a
    bias, a norm) instead of FP8. At worst one piece holds all R such elements of its unit: ``(N - 1) R`` of those
    bytes more per gather, plus ``N (WIRE_ALIGN - 1)``, for every gather of a unit with FP8 weights (each block
    before forward and backward, the one held from forward into backward once). R is the last unit's (the
    benchmark's blocks are alike). On tiny it is a few percent of the blocks' gather, on 5M and up under 1%.
    """
    recipe = gather_recipe_of(system)
    per_unit = sample.get("last_unit_quantized", 0)
    if recipe is None or ranks < 2 or not per_unit:
        return 0.0
    gathers = 2 * sample["quantized_params"] // per_unit - (1 if system in HOLDS_LAST_UNIT else 0)
    other = sample["last_unit_params"] - per_unit
    return gathers * ((ranks - 1) * other * (compute_bytes - QUANTIZED_GATHER_BYTES[recipe])
                      + ranks * (WIRE_ALIGN - 1))


def fp8_gather_targets(rows: List[dict], find) -> List[dict]:
    """Per FP8 gather row: its blocks' all-gather bytes against the bf16 ZeRO-3 row's (the shape's minimum plus at
    most the wire's padding, within ``FP8_GATHER_TOLERANCE``), its whole step's against theory, and its step time
    as a fraction of the floor."""
    out = []
    for system in OURS_FP8:
        details, verdicts = [], []
        for row in (r for r in rows if r["system"] == system and r["rounds_ok"] and r["ranks"] > 1):
            base = find(row["workload"], row["size"], row["ranks"], ZERO3)
            if base is None:
                continue
            root = 2 * row["root_params"]  # bf16: both rows gather the root alike
            got, bf16 = (sum(r["bytes"].get("all_gather", {}).values()) for r in (row, base))
            ours_theory, bf16_theory = row["bytes_theory"]["all_gather"], base["bytes_theory"]["all_gather"]
            blocks, minimum = (got - root) / (bf16 - root), (ours_theory - root) / (bf16_theory - root)
            padding = row.get("wire_padding", 0.0) / (bf16 - root)
            whole, theory = got / bf16, ours_theory / bf16_theory
            verdicts.append(minimum - FP8_GATHER_TOLERANCE <= blocks <= minimum + padding + FP8_GATHER_TOLERANCE)
            floor = "-" if row.get("of_floor") is None else f"{row['of_floor']:.2f}"
            floor_bf16 = "-" if base.get("of_floor") is None else f"{base['of_floor']:.2f}"
            details.append(f"{row['size']} {row['ranks']} ranks: blocks {blocks:.3f}x (this shape: {minimum:.3f}x "
                           f"+ wire padding up to {padding:.3f}x), whole step {whole:.3f}x (theory {theory:.3f}x); "
                           f"{floor} of the floor (bf16 ZeRO-3 {floor_bf16})")
        weight = "1 + 1/32 bytes per FP8 weight" if gather_recipe_of(system) == "mxfp8" else "1 byte per FP8 weight"
        out.append(_target(f"{LABELS[system]}: the blocks' all-gather bytes of bf16 ZeRO-3's, the shape's minimum "
                           f"({weight}, 2 per bias and norm) + at most the wire's padding, "
                           f"±{FP8_GATHER_TOLERANCE}, every shape", verdicts, details))
    return out


def relative_spread(times: List[float]) -> float:
    """Half the inter-quartile range of some step times, relative to their median."""
    return (_quantile(times, 0.75) - _quantile(times, 0.25)) / 2 / statistics.median(times)


def spread(row: dict) -> float:
    """Half the inter-quartile range of a row's step times, relative to their median."""
    step = row["step_s"]
    return (step["p75"] - step["p25"]) / 2 / step["median"]


def ratio_spread(a: dict, b: dict) -> float:
    """Relative spread of the ratio of two rows' step times (their spreads added in quadrature).

    Infinite when a row has fewer than 3 timed steps: its spread is then unknown, not zero.
    """
    if min(a["step_s"].get("n", 3), b["step_s"].get("n", 3)) < 3:
        return math.inf
    return math.hypot(spread(a), spread(b))


def resolved(effect: float, threshold: float, noise: float, ok: bool) -> Optional[bool]:
    """``ok``, or None when the noise hides the answer.

    A verdict needs the spread to be smaller than the effect itself (else not even its
    sign is known) and than the effect's distance from the target's threshold (else
    the run cannot tell which side of the target it is on).
    """
    if noise >= abs(effect) or noise >= abs(effect - threshold):
        return None
    return ok


def _name(row: dict) -> str:
    return f"{row['workload']} {row['size']} N={row['ranks']} {row['label']}"


def _target(name: str, verdicts: List[Optional[bool]], details: List[str], complete: bool = True) -> dict:
    """Status of a target from its verdicts: True, False, or None (not resolvable through the noise)."""
    if not verdicts:
        status = "not measured"
    elif False in verdicts:
        status = "fail"
    elif None in verdicts:
        status = NOISE
    else:
        status = "pass" if complete else "pass (partial)"
    return {"target": name, "status": status, "details": details}


def format_targets(results: List[dict]) -> str:
    lines = []
    for t in results:
        lines.append(f"[{t['status']}] {t['target']}")
        lines.extend(f"    {d}" for d in t["details"])
    return "\n".join(lines)
