"""Regenerate the docs' generated blocks (argument reference, listings, sample outputs) from the code.

    python tools/regenerate_docs.py            # rewrite the cheap blocks (seconds)
    python tools/regenerate_docs.py --run      # also rerun the sample commands (minutes: torchrun, 4 ranks)
    python tools/regenerate_docs.py --check    # exit 1 naming every block that differs (nothing written)
    python tools/regenerate_docs.py --check --run   # the sample outputs too, timings masked

Why: hand-copied outputs drift (a sample log that its command no longer prints, a table
whose columns the tool changed, an argument added and documented nowhere). Each block
in a doc sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``
and is produced here by a function of the code: the argument tables from
``build_parser()``, the listings from the files on disk, the sample outputs by running
their commands. ``--check`` compares the expensive sample outputs with their numbers
that depend on the machine's speed (times, memory, throughput) masked.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@dataclasses.dataclass(frozen=True)
class Block:
    """One generated block: where it lives, how it is made, whether making it runs a job."""

    name: str
    doc: str  # relative to the repository root
    make: Callable[[], str]
    runs_a_job: bool = False
    mask: Tuple[str, ...] = ()  # regular expressions of machine-dependent numbers (``--check --run``)


# ----------------------------------------------------------------------------- cheap blocks

_OWN_DEFAULT = re.compile(r"\(?default: ([^)]*)\)?")


def _default_text(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    own = _OWN_DEFAULT.search(action.help or "")
    if own and "%(default)" not in own.group(0):
        return own.group(1).strip()
    return "-" if action.default is None else f"`{action.default}`"


def _help_text(action: argparse.Action) -> str:
    """The help without its default (the table's own column): ``(default: X)`` dropped, ``(default: X; more)``
    kept as ``(more)``; ``%(default)s`` expanded first (its parenthesis is not the clause's end)."""
    text = action.help or ""
    if "%(default)" in text:
        text = text.replace("%(default)s", str(action.default))
        text = re.sub(r"\s*\(default: [^;,)]*\)", "", text)
        text = re.sub(r"default: [^;,)]*[;,]\s*", "", text)
    else:  # its own words for the default: the default column shows them
        text = re.sub(r"\s*" + _OWN_DEFAULT.pattern, "", text)
    text = text.strip().rstrip(";,")
    if action.choices:
        text = (text + "; " if text else "") + "choices: " + ", ".join(f"`{c}`" for c in action.choices)
    return text.replace("|", "\\|")


def arguments_reference() -> str:
    """Every ``pretrain_gpt.py`` argument by group, with its default, from the parser itself."""
    from megatron.fsdp_training.arguments import build_parser

    parser = build_parser()
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.default is not argparse.SUPPRESS]
        if not actions:
            continue
        out += [f"**{group.title}**", "", "| argument | default | meaning |", "|---|---|---|"]
        out += [f"| `{' / '.join(a.option_strings)}` | {_default_text(a)} | {_help_text(a)} |" for a in actions]
        out.append("")
    return "\n".join(out).rstrip()


def memory_report_fields() -> str:
    """The fields of ``memory_report()``'s dataclass, in order."""
    from megatron.fsdp.wrap.module import PersistentMemory

    names = ", ".join(f"`{f.name}`" for f in dataclasses.fields(PersistentMemory))
    return (f"`model.memory_report()` returns the persistent bytes per rank as a frozen dataclass with the "
            f"fields {names} and the property `total`.")


def _first_doc_line(path: str) -> str:
    """A tool's one-line purpose: its docstring's first line, or a shell script's first comment."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".py"):
        match = re.search(r'^(?:[^"]*?\n)*?\s*"""(.+?)(?:\n|""")', text)
        return match.group(1).strip() if match else ""
    comment = []  # a shell script: its first comment's first sentence (it may span lines)
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            break
        comment.append(line[1:].strip())
    sentence = " ".join(comment).split(". ")[0]
    return sentence.rstrip(".")


def _tool_files() -> List[str]:
    out = []
    for folder in ("tools", "tools/bench", "tools/checkpoint"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if (name.endswith((".py", ".sh")) and name != "__init__.py") and os.path.isfile(os.path.join(ROOT, folder, name)):
                out.append(f"{folder}/{name}")
    return out


def tools_listing() -> str:
    """Every script under tools/ (and tools/bench/, tools/checkpoint/) with its first docstring line."""
    return "\n".join(f"- `{os.path.relpath(path, 'tools')}`: {_first_doc_line(os.path.join(ROOT, path))}"
                     for path in _tool_files())


LAYOUT = (
    ("megatron/fsdp/", "the engine: `fully_shard`, `FullyShardedOptimizer`, `MixedPrecision` (torch only)"),
    ("megatron/fsdp/commands.py", "the installed commands' names (`megatron-fsdp-pretrain`, `-convert`, `-inspect`, "
                                  "`-preprocess`, `-generate`, `-estimate`) that every message tells a user to run"),
    ("megatron/fsdp/mcore/", "the Megatron-Core adapter: `FullyShardedDataParallel`, its optimizer "
                             "([docs/adapter.md](docs/adapter.md))"),
    ("megatron/fsdp/mcore_cpu/", "the CPU emulation of Megatron-Core and Transformer Engine (gloo, CPU FP8 layers), "
                                 "kept apart from the adapter"),
    ("megatron/fsdp_training/", "the training job behind `pretrain_gpt.py` ([docs/training.md](docs/training.md), "
                                "[docs/arguments.md](docs/arguments.md))"),
    ("megatron/fsdp_training/tools/", "the installed tools: checkpoint conversion and inspection, preprocessing, "
                                      "generation, the estimate ([tools/README.md](tools/README.md))"),
    ("pretrain_gpt.py", "Megatron-LM's entry point: `torchrun ... pretrain_gpt.py --use-megatron-fsdp ...`"),
    ("tests/", "pytest suite: single-process and multi-process (gloo) tests, `slow` parity matrix "
               "([docs/testing.md](docs/testing.md))"),
    ("examples/", None),
    ("docs/", "design and usage documentation (see [docs/index.md](docs/index.md))"),
    ("tools/", "benchmarks, reports, preprocessing, checkpoint tools ([tools/README.md](tools/README.md))"),
    (".ci/run", "the CI entry point: runs the set-up commands above, the two of each environment"),
)


def layout_table() -> str:
    """The README's map of the repository; the examples row lists what examples/ holds."""
    rows = ["| Path | What it holds |", "|------|---------------|"]
    for path, what in LAYOUT:
        if what is None:
            files = sorted(n for n in os.listdir(os.path.join(ROOT, path)) if not n.startswith((".", "_")))
            what = "; ".join(f"`{n}`: {_first_doc_line(os.path.join(ROOT, path, n)).rstrip('.')}" for n in files)
        rows.append(f"| `{path}` | {what} |")
    return "\n".join(rows)


def _help_of(script: str) -> str:
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    return "```\n" + out.stdout.rstrip() + "\n```"


def inspect_help() -> str:
    return _help_of("tools/checkpoint/inspect.py")


# ----------------------------------------------------------------------------- sample outputs (run a job)

TRAINING_SAMPLE = ["--mock-data", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                   "--train-iters", "20", "--log-interval", "10", "--eval-interval", "10"]
TIMING = (r"elapsed time per iteration \(ms\): [0-9.]+", r"peak memory \(MiB\) per rank:[ 0-9]+",
          r"total time \(s\): [0-9.]+", r"time in training steps \(s\): [0-9.]+", r"tokens per second: [0-9.]+",
          r"max over ranks and iterations: [0-9]+")


def training_log() -> str:
    """The command and what it prints on stdout (4 CPU ranks; the warnings filter keeps stderr empty)."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    command = ["torchrun", "--nproc_per_node", "4", "pretrain_gpt.py"] + TRAINING_SAMPLE
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                          "--master_port", "29561", "pretrain_gpt.py"] + TRAINING_SAMPLE,
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    if out.returncode:
        raise RuntimeError(f"the sample command failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    shown = " ".join(command[:4]) + " \\\n    " + " ".join(TRAINING_SAMPLE[:4]) + " \\\n    " + " ".join(TRAINING_SAMPLE[4:])
    return f"```bash\n{shown}\n```\n\n```\n{out.stdout.rstrip()}\n```"


def adapter_table() -> str:
    """``python tools/adapter_report.py``'s table, verbatim."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "adapter_report.py")], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=3000)
    if out.returncode:
        raise RuntimeError(f"tools/adapter_report.py failed:\n{out.stderr[-2000:]}")
    return "```\n" + out.stdout.rstrip() + "\n```"


def _estimate_tables(*flags: str) -> str:
    """``python tools/estimate_at_scale.py``'s table (the simulations of docs/estimate.md), verbatim."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "estimate_at_scale.py"), *flags],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=6000)
    if out.returncode:
        raise RuntimeError(f"tools/estimate_at_scale.py failed:\n{out.stderr[-2000:]}")
    return out.stdout.rstrip()


def estimate_at_scale() -> str:
    return _estimate_tables()


def estimate_published() -> str:
    return _estimate_tables("--published")


def estimate_vs_measured() -> str:
    """``python tools/estimate_vs_measured.py``'s table (this machine's measured steps beside the time model)."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "estimate_vs_measured.py")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=6000)
    if out.returncode:
        raise RuntimeError(f"tools/estimate_vs_measured.py failed:\n{out.stderr[-2000:]}")
    return out.stdout.rstrip()


def not_built_table() -> str:
    """The Megatron-LM flags the job does not build and why (``arguments/not_built.py``)."""
    from megatron.fsdp_training.arguments.not_built import not_built_table as table

    return table().rstrip("\n")


BLOCKS = (
    Block("arguments", "docs/arguments.md", arguments_reference),
    Block("not-built", "docs/arguments.md", not_built_table),
    Block("memory-report-fields", "README.md", memory_report_fields),
    Block("tools", "tools/README.md", tools_listing),
    Block("layout", "README.md", layout_table),
    Block("inspect-help", "docs/checkpoints.md", inspect_help),
    Block("training-log", "docs/training.md", training_log, runs_a_job=True, mask=TIMING),
    Block("adapter-parity", "docs/adapter.md", adapter_table, runs_a_job=True,
          mask=(r"(?m) [0-9.]+$", r"[0-9]\.[0-9]{2}e[-+][0-9]{2}")),  # seconds; errors below 1e-5 vary by run
    Block("estimate-at-scale", "docs/estimate.md", estimate_at_scale, runs_a_job=True,
          mask=(r"(?m)\| [0-9]+, [0-9.]+ \|$",)),  # the estimate's own seconds and host memory
    Block("estimate-published", "docs/estimate.md", estimate_published, runs_a_job=True),
    Block("estimate-vs-measured", "docs/estimate.md", estimate_vs_measured, runs_a_job=True,
          mask=(r"[0-9]+\.[0-9]+",)),  # every timing and ratio depends on the machine
)


# ----------------------------------------------------------------------------- the blocks in the docs

def _markers(name: str) -> Tuple[str, str]:
    return f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"


def current(block: Block) -> Optional[str]:
    """The block's present text in its doc, or None when the doc has no such block."""
    with open(os.path.join(ROOT, block.doc), encoding="utf-8") as f:
        text = f.read()
    start, end = _markers(block.name)
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def write(block: Block, body: str) -> None:
    path = os.path.join(ROOT, block.doc)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = _markers(block.name)
    if start not in text or end not in text:
        raise SystemExit(f"{block.doc}: no '{start}' ... '{end}' markers for block {block.name}")
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{before}{start}\n{body}\n{end}{after}")


def _masked(text: str, patterns: Tuple[str, ...]) -> str:
    for pattern in patterns:
        text = re.sub(pattern, "#", text)
    return text


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 if a block differs")
    p.add_argument("--run", action="store_true", help="also the blocks that run a job (sample outputs)")
    p.add_argument("--only", nargs="+", choices=[b.name for b in BLOCKS], default=None, help="just these blocks")
    args = p.parse_args(argv)
    chosen = [b for b in BLOCKS if (args.only is None or b.name in args.only)
              and (args.run or not b.runs_a_job or args.only)]
    drifted: Dict[str, str] = {}
    for block in chosen:
        body, present = block.make(), current(block)
        if args.check:
            if present is None or _masked(present, block.mask) != _masked(body, block.mask):
                drifted[block.name] = block.doc
        elif present != body:
            write(block, body)
            print(f"rewrote {block.name} in {block.doc}")
    if args.check:
        for name, doc in drifted.items():
            print(f"{doc}: generated block '{name}' differs from the code: run python tools/regenerate_docs.py"
                  f"{' --run' if any(b.runs_a_job for b in BLOCKS if b.name == name) else ''} --only {name}")
        print(f"{len(chosen) - len(drifted)}/{len(chosen)} generated blocks up to date")
        return 1 if drifted else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
