"""The checkpoint flags: where and how often to save, what to load, the format, non-persistent checkpoints,
and fault tolerance (process-group timeout, the SIGTERM handler).

Megatron-LM's names, defaults and meanings; each data-parallel implementation has its format
(``fsdp_dtensor`` with ``--use-megatron-fsdp``, ``torch_dist`` on the baseline) and the converter
moves between them. Non-persistent checkpoints are Megatron-LM's: ``--non-persistent-save-interval N``
saves every N iterations with ``--save`` (not where the persistent save runs); ``global`` writes a
normal checkpoint in ``--non-persistent-global-ckpt-dir`` (default ``<--save>/non_persistent``, only
the newest kept), ``local`` each rank's own part in ``--non-persistent-local-ckpt-dir``; ``in_memory``
is refused, as Megatron-LM's ``validate_args`` does. Every rule runs before any process group exists,
so a refusal is one line and no collective can hang; the saves and loads themselves are
``checkpointing/`` (outside this package). docs/checkpoints.md and docs/fault-tolerance.md
(non-persistent checkpoints) say what each flag does here.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import List

from megatron.fsdp.commands import CONVERT

from ..errors import refuse
from .substitutions import Substitution

STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")
NON_PERSISTENT_TYPES = ("global", "local", "in_memory")
NON_PERSISTENT_ALGOS = ("fully_parallel", "atomic")


def add_checkpointing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between saves (and one at the end)")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument("--ckpt-format", choices=["fsdp_dtensor", "torch_dist", "torch", "torch_dcp"], default=None,
                   help="fsdp_dtensor with --use-megatron-fsdp (the default there), torch_dist (Megatron-Core "
                        f"dist_checkpointing) for the Megatron-Core DDP baseline (its default); {CONVERT} "
                        "converts between them")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="Megatron-LM: load whichever format the checkpoint has. Here each data-parallel "
                        "implementation loads its own --ckpt-format (said at start-up); convert the other with "
                        f"{CONVERT}")
    g.add_argument("--dist-ckpt-strictness", choices=STRICTNESS, default="assume_ok_unexpected",
                   help="key mismatches on load. Here loads always stop on missing or unexpected keys "
                        "(raise_all); a value that would continue is said at start-up")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="torch_dist saves of the DistributedOptimizer: its state per parameter in model space "
                        "(loads at any TP/PP/DP) instead of Megatron-LM's default dp_reshardable flat buckets. "
                        "fsdp_dtensor's optimizer state is always per parameter")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer and scheduler state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG states")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="at load, train with this command line's learning-rate and weight-decay schedule, "
                        "not the checkpoint's (Megatron-LM's flag)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="at load, keep the checkpoint's learning-rate and weight-decay schedule whatever this "
                        "command line says (Megatron-LM's flag); without either flag a different schedule stops "
                        "the load")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only; iteration, optimizer, scheduler and data start afresh")
    g.add_argument("--exit-interval", type=int, default=None, help="exit after an iteration divisible by N "
                   "(saving first with --save)")
    g.add_argument("--async-save", action="store_true", help="plan, write and publish checkpoints in the "
                   "background: training blocks only to snapshot this rank's pieces into host memory "
                   "(docs/checkpoints.md)")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="iterations between non-persistent saves (needs --save and --non-persistent-ckpt-type; "
                        "an iteration of --save-interval saves persistently instead)")
    g.add_argument("--non-persistent-ckpt-type", choices=NON_PERSISTENT_TYPES, default=None,
                   help="kind of the non-persistent checkpoints: global (a full checkpoint, only the newest "
                        "kept), local (each rank its own part, node-local); in_memory is refused, as in "
                        "Megatron-LM. --load loads the newer of --load's and the non-persistent checkpoint")
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="directory of the global non-persistent checkpoints (default: <--save>/non_persistent "
                        "when saving, <--load>/non_persistent when loading)")
    g.add_argument("--non-persistent-local-ckpt-dir", default=None,
                   help="directory of the local non-persistent checkpoints (node-local storage; every rank "
                        "writes rank_<r>/ in it); required by --non-persistent-ckpt-type local")
    g.add_argument("--non-persistent-local-ckpt-algo", choices=NON_PERSISTENT_ALGOS, default="fully_parallel",
                   help="Megatron-LM's algorithm for local checkpoints; here every rank writes all of its own "
                        "pieces (atomic), so that no rank needs another's files (said at start-up)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="process-group timeout: a collective some rank never joins fails after this long, "
                   "naming the collective (Megatron-LM's flag and default)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, save a checkpoint at the next iteration boundary (every rank), then exit")



# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def validate_checkpointing(args: argparse.Namespace) -> None:
    """Intervals, what --load needs, the scheduler's two exclusive load rules, and the format."""
    for name in ("save_interval", "exit_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            refuse(f"--{name.replace('_', '-')}={value} must be at least 1")
    if args.save_interval is not None and not args.save:
        refuse("--save-interval needs --save DIR")
    for flag, value in (("--finetune", args.finetune), ("--ckpt-step", args.ckpt_step is not None)):
        if value and not args.load:
            refuse(f"{flag} needs --load DIR")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        refuse("--override-opt_param-scheduler (this command line's schedule) and "
              "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude each other; pass one")
    _validate_ckpt_format(args)


def _validate_ckpt_format(args: argparse.Namespace) -> None:
    """Each data-parallel implementation has its format (fsdp_dtensor / torch_dist); the converter moves between them."""
    native = "fsdp_dtensor" if args.use_megatron_fsdp else "torch_dist"
    if args.ckpt_format is None:
        args.ckpt_format = native
    if args.ckpt_format in ("torch", "torch_dcp"):
        refuse(f"--ckpt-format {args.ckpt_format} is not implemented: use --ckpt-format {native}")
    if args.ckpt_format == native:
        return
    if args.use_megatron_fsdp:
        refuse("--ckpt-format torch_dist is Megatron-Core's dist_checkpointing format of its DDP / "
              "DistributedOptimizer: --use-megatron-fsdp saves and loads --ckpt-format fsdp_dtensor; convert a "
              f"torch_dist checkpoint with: {CONVERT} from-torch-dist TORCH_DIST_DIR FSDP_DIR (and to-torch-dist "
              "back)")
    refuse("--ckpt-format fsdp_dtensor needs --use-megatron-fsdp: the Megatron-Core DDP baseline saves and loads "
          f"--ckpt-format torch_dist; convert an fsdp_dtensor checkpoint with: {CONVERT} to-torch-dist FSDP_DIR "
          "TORCH_DIST_DIR (and from-torch-dist back)")


def validate_async_save(args: argparse.Namespace) -> None:
    if args.async_save and not args.save:
        refuse("--async-save needs --save DIR")
    if args.async_save and args.ckpt_format == "torch_dist":
        refuse("--async-save is implemented for --ckpt-format fsdp_dtensor (--use-megatron-fsdp); "
              "the baseline's torch_dist saves are synchronous")


def validate_non_persistent(args: argparse.Namespace) -> None:
    """Megatron-LM's rules, plus a line for every flag that would otherwise do nothing (never silently dropped)."""
    kind, interval = args.non_persistent_ckpt_type, args.non_persistent_save_interval
    if kind == "in_memory":
        refuse("--non-persistent-ckpt-type in_memory is not implemented (Megatron-LM refuses it too: "
              "\"Currently only global and local checkpoints are supported\"): use global or local")
    if interval is not None and interval < 1:
        refuse(f"--non-persistent-save-interval={interval} must be at least 1")
    if interval is not None and kind is None:
        refuse("--non-persistent-save-interval needs --non-persistent-ckpt-type global or local")
    if interval is not None and not args.save:
        refuse("--non-persistent-save-interval needs --save DIR (Megatron-LM saves non-persistent checkpoints "
              "only with --save)")
    if args.non_persistent_global_ckpt_dir and kind != "global":
        refuse("--non-persistent-global-ckpt-dir is read only with --non-persistent-ckpt-type global")
    if args.non_persistent_local_ckpt_dir and kind != "local":
        refuse("--non-persistent-local-ckpt-dir is read only with --non-persistent-ckpt-type local")
    if args.non_persistent_local_ckpt_algo != "fully_parallel" and kind != "local":
        refuse("--non-persistent-local-ckpt-algo is read only with --non-persistent-ckpt-type local")
    if kind is None:
        return
    if kind == "local" and not args.non_persistent_local_ckpt_dir:
        refuse("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (node-local storage), "
              "as in Megatron-LM")
    if not (args.use_megatron_fsdp and args.ckpt_format == "fsdp_dtensor"):
        refuse("--non-persistent-ckpt-type is implemented for --use-megatron-fsdp --ckpt-format fsdp_dtensor; "
              f"this job uses --ckpt-format {args.ckpt_format}: use --save-interval")
    if interval is None and not args.load:
        refuse(f"--non-persistent-ckpt-type {kind} without --non-persistent-save-interval only loads: it needs "
              "--load DIR (or pass --non-persistent-save-interval N to save)")
    _check_not_a_persistent_directory(args)
    from ..checkpointing import paths

    if kind == "global" and args.non_persistent_global_ckpt_dir and not paths.global_dir_is_default(
            args.non_persistent_global_ckpt_dir, args.save, args.load):
        # before anything is written there (the probe below included): it may be another run's --save
        owners = paths.non_persistent_owners(args.save, args.load, saving=bool(interval))
        problem = paths.non_persistent_owner_problem(Path(args.non_persistent_global_ckpt_dir),
                                                     "--non-persistent-global-ckpt-dir", owners, interval is not None)
        if problem:
            refuse(problem)
    if kind == "global" and interval is not None and args.non_persistent_global_ckpt_dir:
        problem = paths.save_dir_problem(args.non_persistent_global_ckpt_dir)
        if problem:
            refuse(problem.replace("--save", "--non-persistent-global-ckpt-dir", 1))


def _check_not_a_persistent_directory(args: argparse.Namespace) -> None:
    """A non-persistent directory that is --save's or --load's own would share its tracker, and the removal of
    older non-persistent checkpoints would remove the persistent ones."""
    for flag, given in (("--non-persistent-global-ckpt-dir", args.non_persistent_global_ckpt_dir),
                        ("--non-persistent-local-ckpt-dir", args.non_persistent_local_ckpt_dir)):
        for other, path in (("--save", args.save), ("--load", args.load)):
            if given and path and os.path.realpath(given) == os.path.realpath(path):
                refuse(f"{flag} {given} is the {other} directory: its non-persistent saves would replace the "
                      "persistent checkpoints and their tracker; pass another directory (the global default is "
                      "<--save>/non_persistent)")


def validate_fault_tolerance(args: argparse.Namespace, world_size: int) -> None:
    """Timeout, signal handler, fault injection and the --save/--load paths: all before any process group."""
    from ..checkpointing import files as checkpoint_files, paths as checkpoint_paths

    if args.distributed_timeout_minutes < 1:
        refuse(f"--distributed-timeout-minutes={args.distributed_timeout_minutes} must be at least 1")
    if args.exit_signal_handler and not args.save:
        refuse("--exit-signal-handler saves a checkpoint on SIGTERM: it needs --save DIR")
    try:
        checkpoint_files.check_fault_spec(world_size)
    except ValueError as exc:
        refuse(str(exc))
    if args.save:
        problem = checkpoint_paths.save_dir_problem(args.save)
        if problem:
            refuse(problem)
        if int(os.environ.get("RANK", "0")) == 0:  # a failed save's leftovers would fill the disk again
            removed = checkpoint_paths.remove_stale_temporaries(args.save)
            if removed:
                print(f" removed {len(removed)} unfinished save(s) of a dead job from {args.save}: "
                      f"{', '.join(removed)}", flush=True)
            aside = checkpoint_paths.set_aside_copies(args.save)
            if aside:
                print(f" {args.save} holds {len(aside)} copies set aside by an interrupted re-save of an "
                      f"iteration ({', '.join(aside)}): the next save that completes removes them", flush=True)
    if args.load:
        problem = checkpoint_paths.load_dir_problem(args.load)
        if problem:
            refuse(problem)


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def format_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """The format auto-detection and a load strictness that would continue: each load checks its own way."""
    out = []
    if args.auto_detect_ckpt_format:
        out.append(Substitution("--auto-detect-ckpt-format", f"--ckpt-format {args.ckpt_format}",
                                f"each data-parallel implementation loads its own format; convert with {CONVERT}"))
    if args.dist_ckpt_strictness not in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
        out.append(Substitution(f"--dist-ckpt-strictness {args.dist_ckpt_strictness}", "raise_all",
                                "a load never continues with missing or unexpected keys"))
    return out


def non_persistent_substitutions(args: argparse.Namespace) -> List[Substitution]:
    out = []
    if args.non_persistent_ckpt_type == "local" and args.non_persistent_local_ckpt_algo == "fully_parallel":
        out.append(Substitution("--non-persistent-local-ckpt-algo fully_parallel",
                                "atomic (every rank writes all of its own pieces)",
                                "a local checkpoint loads from the rank's own files only"))
    if args.non_persistent_save_interval and args.async_save:
        out.append(Substitution("--async-save (non-persistent saves)", "synchronous non-persistent saves",
                                "the background writer serves the persistent saves only"))
    return out
