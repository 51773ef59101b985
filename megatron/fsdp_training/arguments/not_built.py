"""Megatron-LM flags of features this job does not build, and the one line an unknown flag gets.

argparse's own error prints the whole usage (some 170 lines) and then the error, on every rank. The
job's parser (``parser.JobArgumentParser``) turns every parse error into one ``ArgumentError`` instead,
printed once by rank 0 before any process group exists; a flag listed here says why it is not built
and what to use (docs/arguments.md's "Not in this job's command line" table is generated from
``NOT_BUILT``, so the two say the same).
"""

from __future__ import annotations

import re
from typing import Dict

from megatron.fsdp.commands import PRETRAIN

_OFFLOAD = ("Megatron-LM's HybridDeviceOptimizer keeps optimizer state and steps in host memory; the engine "
            "shards the state over the data-parallel ranks instead and has no host offload (on a CPU-only machine "
            "every tensor is in host memory already): for less state per rank use a higher "
            "--data-parallel-sharding-strategy or --use-precision-aware-optimizer with bf16 moments")

NOT_BUILT: Dict[str, str] = {
    "--use-torch-fsdp2": "Megatron-LM's torch FSDP2 wrapper is another data-parallel backend; this job's are "
                         "Megatron-Core's DDP / DistributedOptimizer and --use-megatron-fsdp (this engine, ZeRO-3 "
                         "by default, FSDP2's sharding); FSDP2 runs here only as a benchmark peer "
                         "(docs/performance.md)",
    "--optimizer-cpu-offload": _OFFLOAD,
    "--optimizer-offload-fraction": _OFFLOAD,
    "--overlap-cpu-optimizer-d2h-h2d": _OFFLOAD,
    "--use-torch-optimizer-for-cpu-offload": _OFFLOAD,
}

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def parse_error_line(message: str) -> str:
    """One line for an argparse error: the flags this job does not build say why, any other names ``--help``."""
    found = _UNRECOGNIZED.match(message)
    if found:
        flags = [word.split("=", 1)[0] for word in found.group(1).split() if word.startswith("--")]
        known = [flag for flag in dict.fromkeys(flags) if flag in NOT_BUILT]
        if known:
            reasons = "; ".join(f"{flag}: {NOT_BUILT[flag]}" for flag in known)
            return f"{', '.join(known)} {'is' if len(known) == 1 else 'are'} not built in this job ({reasons})"
    return f"{message} ({PRETRAIN} --help lists every flag with its meaning and default)"


def not_built_table() -> str:
    """docs/arguments.md's table of these flags (tools/regenerate_docs.py)."""
    rows, by_reason = ["| flag | why not |", "|---|---|"], {}
    for flag, reason in NOT_BUILT.items():
        by_reason.setdefault(reason, []).append(flag)
    for reason, flags in by_reason.items():
        rows.append(f"| {', '.join(f'`{f}`' for f in flags)} | {reason} |")
    return "\n".join(rows) + "\n"
