"""The logging and profiling flags: the iteration line and what it adds, TensorBoard and wandb, Python's log
level, and Megatron-LM's ``--profile`` window.

Megatron-LM's names, defaults and meanings. A writer whose package is missing, or a flag that needs
a writer without one, stops the job at start-up with the ``pip install`` or the flag that fixes it,
instead of a traceback after the model is built; the writers themselves are ``logs/writers.py`` and
the profiler ``profiler.py`` (outside this package). docs/training.md ("Logs", "Throughput,
TensorBoard and wandb") says what each flag does here.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from typing import List

import torch

from ..errors import refuse
from ..logs.logging_config import uses_torch_profiler
from .substitutions import Substitution


def add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and profiling")
    g.add_argument("--log-interval", type=int, default=1,
                   help="iterations per log line (times and losses averaged over them)")
    g.add_argument("--log-throughput", action="store_true",
                   help="add Megatron-LM's model TFLOP/s per GPU and tokens/s per rank to the iteration line")
    g.add_argument("--log-params-norm", action="store_true", help="log the L2 norm of the parameters")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="log the number of zeros in the gradients")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0,
                   help="Megatron-LM's timer granularity: the job's timers (forward-backward, all-grads-sync, "
                        "optimizer) are its level 1; 2 adds none")
    g.add_argument("--logging-level", type=int, default=None, help="level of the root Python logger")
    g.add_argument("--tensorboard-dir", default=None, help="write scalars here (needs tensorboard)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write forward-backward, optimizer and data-parallel sync times (ms) as scalars")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write the peak and current memory as scalars")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="write the validation perplexity as a scalar")
    g.add_argument("--wandb-project", default=None, help="wandb project name (enables wandb; needs the wandb package)")
    g.add_argument("--wandb-exp-name", default=None, help="wandb run name")
    g.add_argument("--wandb-save-dir", default=None,
                   help="directory of the wandb run (default: --save/wandb, else ./wandb)")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start+1 .. --profile-step-end: the CUDA profiler range "
                        "for nsys, or a torch.profiler trace with --use-pytorch-profiler (always on CPU)")
    g.add_argument("--profile-step-start", type=int, default=10, help="iteration after which profiling starts")
    g.add_argument("--profile-step-end", type=int, default=12, help="iteration at which profiling stops")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[],
                   help="global ranks to profile (default: all, as Megatron-LM)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="record with torch.profiler; the trace goes to --tensorboard-dir")



def _missing(package: str) -> bool:
    return importlib.util.find_spec(package) is None


# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def validate_writers(args: argparse.Namespace) -> None:
    """Each requested writer's package is importable, and the flags that need a writer have one."""
    if args.tensorboard_dir and _missing("tensorboard"):
        refuse("--tensorboard-dir needs the tensorboard package, which is not installed: "
              "pip install tensorboard (or drop --tensorboard-dir)")
    if args.log_timers_to_tensorboard and not (args.tensorboard_dir or args.wandb_project):
        refuse("--log-timers-to-tensorboard needs --tensorboard-dir (or --wandb-project) to write to")
    if args.wandb_project is None:
        if args.wandb_exp_name or args.wandb_save_dir:
            refuse("--wandb-exp-name and --wandb-save-dir need --wandb-project")
        return
    if not args.wandb_project.strip():
        refuse("--wandb-project is empty; give a project name")
    if _missing("wandb"):
        refuse("--wandb-project needs the wandb package, which is not installed: pip install wandb "
              "(or drop --wandb-project)")


def validate_scalars(args: argparse.Namespace) -> None:
    """The memory and perplexity scalars need a writer; ``--logging-level`` sets the root logger's level."""
    if args.log_memory_to_tensorboard and not (args.tensorboard_dir or args.wandb_project):
        refuse("--log-memory-to-tensorboard needs --tensorboard-dir (or --wandb-project) to write to")
    if args.log_validation_ppl_to_tensorboard and not (args.tensorboard_dir or args.wandb_project):
        refuse("--log-validation-ppl-to-tensorboard needs --tensorboard-dir (or --wandb-project) to write to")
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)


def validate_profiling(args: argparse.Namespace) -> None:
    if args.use_pytorch_profiler and not args.profile:
        refuse("--use-pytorch-profiler needs --profile")
    if not args.profile:
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        refuse(f"--profile-step-start {args.profile_step_start} must be at least 0 and below "
              f"--profile-step-end {args.profile_step_end}")
    if uses_torch_profiler(args.profile, args.use_pytorch_profiler) and not args.tensorboard_dir:
        refuse("--profile with torch.profiler writes its trace to --tensorboard-dir: set it")


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def profiling_substitutions(args: argparse.Namespace) -> List[Substitution]:
    if args.profile and not args.use_pytorch_profiler and not torch.cuda.is_available():
        return [Substitution("--profile", f"torch.profiler trace in {args.tensorboard_dir}",
                             "no CUDA profiler without CUDA")]
    return []
