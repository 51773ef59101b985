"""Checkpoints that travel between Megatron-Core releases: the fixture one release writes, another resumes.

A suite runs under one release, so a checkpoint saved under another comes as a small committed
file (``tests/data/release_checkpoints_mcore_<version>.tar.xz``), written by
``tools/checkpoint/release_fixture.py`` under that release. For each format (``fsdp_dtensor`` from
``--use-megatron-fsdp`` ZeRO-3, ``torch_dist`` from Megatron-Core's DDP with its distributed optimizer)
it holds a tiny GPT's checkpoint at iteration ``AT`` of ``ITERATIONS`` on ``RANKS`` ranks, and what
the saving release got when it resumed from it (losses, grad norms, validation losses): a suite
resumes every fixture at the same layout and must reproduce those bitwise, its own release's
trivially, the other's only if nothing a checkpoint holds depends on the release.
"""

from __future__ import annotations

import json
import platform
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Dict, List

RANKS, AT, ITERATIONS = 2, 2, 4
MANIFEST = "manifest.json"
# The tiny GPT of tests/data/checkpoint_v1_tp2.tar.xz, no dropout, a learning-rate schedule that moves.
MODEL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "60",
         "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", str(ITERATIONS), "--eval-interval", str(AT), "--eval-iters", "1", "--lr", "1e-3",
         "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--seed", "7",
         "--mock-data", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
FORMATS: Dict[str, List[str]] = {
    "fsdp_dtensor": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
    "torch_dist": ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"],
}


def fixture_name(version: str) -> str:
    return f"release_checkpoints_mcore_{version}.tar.xz"


def _pretrain(argv: List[str]) -> Dict[str, Any]:
    from .pools import pool_of
    from .pretrain import pretrain_in_pool

    return pool_of(RANKS).run(pretrain_in_pool, timeout=300, argv=argv)[0]


def _resumed(history: Dict[str, Any]) -> Dict[str, Any]:
    return {k: history[k] for k in ("start_iteration", "losses", "grad_norms", "valid", "valid_at_load")}


def write_fixture(out: Path) -> Dict[str, Any]:
    """Save each format at iteration ``AT`` (the run stops there), resume it to ``ITERATIONS``, and pack the
    checkpoints and the resumed histories into ``out`` (a ``.tar.xz``); returns the manifest."""
    import torch

    from megatron.fsdp.mcore_releases import MCORE_VERSION_STRING

    out = Path(out)
    manifest: Dict[str, Any] = {"megatron_core": MCORE_VERSION_STRING, "torch": torch.__version__,
                                "python": platform.python_version(), "ranks": RANKS, "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for fmt, flags in FORMATS.items():
            argv = MODEL + flags
            saved = root / fmt
            _pretrain(argv + ["--save", str(saved), "--save-interval", str(AT), "--exit-interval", str(AT)])
            manifest["formats"][fmt] = {"argv": argv, **_resumed(_pretrain(argv + ["--load", str(saved)]))}
        (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
        partial = out.with_name(out.name + ".partial")
        with tarfile.open(partial, "w:xz") as tar:
            for name in [MANIFEST, *FORMATS]:
                tar.add(root / name, arcname=name)
        partial.replace(out)
    return manifest


def resume_fixture(path: Path, directory: Path) -> Dict[str, Dict[str, Any]]:
    """Unpack ``path`` into ``directory`` and resume each of its checkpoints here; ``{format: {"expected":
    the saving release's resumed history, "got": this release's}}``, plus the manifest under ``"manifest"``."""
    directory = Path(directory)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    with tarfile.open(path, "r:xz") as tar:
        tar.extractall(directory, filter="data")
    manifest = json.loads((directory / MANIFEST).read_text())
    out: Dict[str, Any] = {"manifest": manifest}
    for fmt, expected in manifest["formats"].items():
        got = _pretrain(expected["argv"] + ["--load", str(directory / fmt)])
        out[fmt] = {"expected": {k: v for k, v in expected.items() if k != "argv"}, "got": _resumed(got)}
    return out
