"""The benchmark's PNG: step time and peak memory against model size, one line per system.

One row of two panels per (workload, world size): the median step time and the peak
resident memory per rank, each against the model's parameter count (both axes log scale), so a
reader sees how each system's cost grows from the 5M to the 200M shape and where the
root-heavy and deep-narrow shapes sit. A system that crashed or could not run at a size
has no point there and says so in the legend. A pure function of the table's rows.
"""

from __future__ import annotations

import textwrap

from typing import List, Optional

from tools.bench.spec import LABELS, SYSTEMS

MIB = 1024 * 1024
SKIPPED = "plot: skipped: matplotlib is not installed (pip install -e '.[plot]', or pip install matplotlib)"


def plot(rows: List[dict], path: str, title: str = "") -> Optional[str]:
    """Write the PNG to ``path`` and return it; None if matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = list(dict.fromkeys((r["workload"], r["ranks"]) for r in rows))
    order = list(dict.fromkeys(s for systems in SYSTEMS.values() for s in systems))
    colors = {s: plt.get_cmap("tab20")(i % 20) for i, s in enumerate(order)}  # one colour per system everywhere
    fig, axes = plt.subplots(len(panels), 2, figsize=(14, 4.2 * len(panels)), squeeze=False)
    for (workload, ranks), (ax_time, ax_mem) in zip(panels, axes):
        subset = [r for r in rows if (r["workload"], r["ranks"]) == (workload, ranks)]
        sizes = {r["size"]: r["params"] for r in subset if r.get("params")}
        for system in dict.fromkeys(r["system"] for r in subset):
            mine = sorted((r for r in subset if r["system"] == system and r["rounds_ok"] and r["size"] in sizes),
                          key=lambda r: r["params"])
            missing = [r["size"] for r in subset if r["system"] == system and not r["rounds_ok"]]
            label = LABELS[system] + (f" (none at {', '.join(missing)})" if missing else "")
            for ax, values in ((ax_time, [r["step_s"]["median"] * 1e3 for r in mine]),
                               (ax_mem, [None if r["peak_bytes"] is None else r["peak_bytes"] / MIB for r in mine])):
                points = [(r["params"], v) for r, v in zip(mine, values) if v is not None]
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label,
                        color=colors[system], linestyle="--" if system in ("floor", "unwrapped") else "-")
        for ax, what in ((ax_time, "step ms (lower is better)"), (ax_mem, "peak MiB per rank (lower is better)")):
            ax.set_xscale("log")
            ax.set_yscale("log")  # log-log: a cost proportional to size is a line of slope 1
            if sizes:
                ax.set_xticks(sorted(sizes.values()), [f"{name}\n{n / 1e6:.1f}M" for name, n in
                                                       sorted(sizes.items(), key=lambda kv: kv[1])], fontsize=7)
                ax.minorticks_off()
            ax.set_xlabel("model (parameters)", fontsize=8)
            ax.set_title(f"{workload}, {ranks} rank{'s' if ranks > 1 else ''}: {what}", fontsize=10)
        ax_time.legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=9)  # a long command wraps, not cut
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
