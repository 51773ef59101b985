"""Megatron-LM's non-persistent checkpoint flags: their names, defaults and meanings, and the start-up rules.

Kept apart from ``non_persistent.py`` (the saves and the load) so that argument parsing imports nothing heavy:
this module runs in ``validate_args``, before any process group exists, so every refusal is one line on
every rank and no collective can hang.

Megatron-LM (``megatron/training/arguments.py``, ``checkpointing.py``, ``training.py``):

- ``--non-persistent-save-interval N``: a non-persistent save every N iterations, only with ``--save``, and
  not at an iteration where the persistent save (``--save-interval``) runs;
- ``--non-persistent-ckpt-type``: ``global`` (a normal checkpoint in ``--non-persistent-global-ckpt-dir``,
  default ``<--save>/non_persistent``, only the newest kept), ``local`` (each rank writes its own part to
  ``--non-persistent-local-ckpt-dir``, which it requires), ``in_memory`` (listed, but its ``validate_args``
  refuses it: "Currently only global and local checkpoints are supported"; refused here too);
- ``--non-persistent-local-ckpt-algo`` {``fully_parallel``, ``atomic``}: how local checkpoints treat pieces
  several data-parallel ranks hold.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Tuple

from ..errors import ArgumentError

TYPES = ("global", "local", "in_memory")
ALGOS = ("fully_parallel", "atomic")


def add_non_persistent_args(g) -> None:
    """The five flags, into the checkpoint group of ``megatron_lm``."""
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="iterations between non-persistent saves (needs --save and --non-persistent-ckpt-type; "
                        "an iteration of --save-interval saves persistently instead)")
    g.add_argument("--non-persistent-ckpt-type", choices=TYPES, default=None,
                   help="kind of the non-persistent checkpoints: global (a full checkpoint, only the newest "
                        "kept), local (each rank its own part, node-local); in_memory is refused, as in "
                        "Megatron-LM. --load loads the newer of --load's and the non-persistent checkpoint")
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="directory of the global non-persistent checkpoints (default: <--save>/non_persistent "
                        "when saving, <--load>/non_persistent when loading)")
    g.add_argument("--non-persistent-local-ckpt-dir", default=None,
                   help="directory of the local non-persistent checkpoints (node-local storage; every rank "
                        "writes rank_<r>/ in it); required by --non-persistent-ckpt-type local")
    g.add_argument("--non-persistent-local-ckpt-algo", choices=ALGOS, default="fully_parallel",
                   help="Megatron-LM's algorithm for local checkpoints; here every rank writes all of its own "
                        "pieces (atomic), so that no rank needs another's files (said at start-up)")


def _fail(message: str) -> None:
    raise ArgumentError(message)


def validate_non_persistent(args: argparse.Namespace) -> None:
    """Megatron-LM's rules, plus a line for every flag that would otherwise do nothing (never silently dropped)."""
    kind, interval = args.non_persistent_ckpt_type, args.non_persistent_save_interval
    if kind == "in_memory":
        _fail("--non-persistent-ckpt-type in_memory is not implemented (Megatron-LM refuses it too: "
              "\"Currently only global and local checkpoints are supported\"): use global or local")
    if interval is not None and interval < 1:
        _fail(f"--non-persistent-save-interval={interval} must be at least 1")
    if interval is not None and kind is None:
        _fail("--non-persistent-save-interval needs --non-persistent-ckpt-type global or local")
    if interval is not None and not args.save:
        _fail("--non-persistent-save-interval needs --save DIR (Megatron-LM saves non-persistent checkpoints "
              "only with --save)")
    if args.non_persistent_global_ckpt_dir and kind != "global":
        _fail("--non-persistent-global-ckpt-dir is read only with --non-persistent-ckpt-type global")
    if args.non_persistent_local_ckpt_dir and kind != "local":
        _fail("--non-persistent-local-ckpt-dir is read only with --non-persistent-ckpt-type local")
    if args.non_persistent_local_ckpt_algo != "fully_parallel" and kind != "local":
        _fail("--non-persistent-local-ckpt-algo is read only with --non-persistent-ckpt-type local")
    if kind is None:
        return
    if kind == "local" and not args.non_persistent_local_ckpt_dir:
        _fail("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (node-local storage), "
              "as in Megatron-LM")
    if not (args.use_megatron_fsdp and args.ckpt_format == "fsdp_dtensor"):
        _fail("--non-persistent-ckpt-type is implemented for --use-megatron-fsdp --ckpt-format fsdp_dtensor; "
              f"this job uses --ckpt-format {args.ckpt_format}: use --save-interval")
    if interval is None and not args.load:
        _fail(f"--non-persistent-ckpt-type {kind} without --non-persistent-save-interval only loads: it needs "
              "--load DIR (or pass --non-persistent-save-interval N to save)")
    _check_not_a_persistent_directory(args)
    from ..checkpointing import paths

    if kind == "global" and args.non_persistent_global_ckpt_dir and not paths.global_dir_is_default(args):
        # before anything is written there (the probe below included): it may be another run's --save
        problem = paths.non_persistent_owner_problem(Path(args.non_persistent_global_ckpt_dir),
                                                     "--non-persistent-global-ckpt-dir",
                                                     paths.non_persistent_owners(args), interval is not None)
        if problem:
            _fail(problem)
    if kind == "global" and interval is not None and args.non_persistent_global_ckpt_dir:
        problem = paths.save_dir_problem(args.non_persistent_global_ckpt_dir)
        if problem:
            _fail(problem.replace("--save", "--non-persistent-global-ckpt-dir", 1))


def _check_not_a_persistent_directory(args: argparse.Namespace) -> None:
    """A non-persistent directory that is --save's or --load's own would share its tracker, and the removal of
    older non-persistent checkpoints would remove the persistent ones."""
    import os

    for flag, given in (("--non-persistent-global-ckpt-dir", args.non_persistent_global_ckpt_dir),
                        ("--non-persistent-local-ckpt-dir", args.non_persistent_local_ckpt_dir)):
        for other, path in (("--save", args.save), ("--load", args.load)):
            if given and path and os.path.realpath(given) == os.path.realpath(path):
                _fail(f"{flag} {given} is the {other} directory: its non-persistent saves would replace the "
                      "persistent checkpoints and their tracker; pass another directory (the global default is "
                      "<--save>/non_persistent)")


def non_persistent_substitutions(args: argparse.Namespace) -> List[Tuple[str, str, str]]:
    """(flag, what runs instead, why) for the start-up substitution line."""
    out = []
    if args.non_persistent_ckpt_type == "local" and args.non_persistent_local_ckpt_algo == "fully_parallel":
        out.append(("--non-persistent-local-ckpt-algo fully_parallel",
                    "atomic (every rank writes all of its own pieces)",
                    "a local checkpoint loads from the rank's own files only"))
    if args.non_persistent_save_interval and args.async_save:
        out.append(("--async-save (non-persistent saves)", "synchronous non-persistent saves",
                    "the background writer serves the persistent saves only"))
    return out
