"""Megatron-LM's own trainer (``megatron.training``) with this backend behind ``--use-megatron-fsdp``.

    torchrun --nproc_per_node 8 -m megatron.fsdp.mcore.megatron_lm PATH/pretrain_gpt.py \\
        --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params ...

runs the user's unchanged script as ``__main__`` after ``install()``; a user who edits the script calls
``from megatron.fsdp.mcore import megatron_lm; megatron_lm.install()`` before ``pretrain``. Megatron-LM
picks Megatron-FSDP's classes by module-global name and has no hook for it, so ``install()`` rebinds those
names (``patches.PATCHES`` keeps the record): the data-parallel class, the optimizer factory, the
gradient finalisation (``finalize_model_grads``), the params norm and the ``fsdp_dtensor`` preprocessing
(``trainer_backend.py``). Everything else (flags, schedule, logging, checkpoint files) stays Megatron-LM's. Without
CUDA it also makes the trainer run on CPU processes with gloo (``mcore_cpu/trainer_bridges.py``). megatron-core
ships ``megatron.training`` from 0.17 (Python 3.12); on an older release ``install()`` refuses with one line.
docs/trainers.md has the flags.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from typing import List, Optional

import torch

from megatron.fsdp.commands import PRETRAIN

from megatron.fsdp import mcore_releases as compat
from .data_parallel import FullyShardedDataParallel
from megatron.fsdp.mcore_cpu.patch_record import PATCHES, once, rebind, use_shipped_dataset_helpers
from .trainer_backend import (finalize_factory, fsdp_dtensor_preprocess_factory, optimizer_factory,
                              params_norm_factory)
from .trainer_checkpoints import job_checkpoint_in_megatron_lm


class TrainerUnavailable(RuntimeError):
    """The installed megatron-core has no ``megatron.training``."""


def require_megatron_training() -> None:
    if not compat.HAS_MEGATRON_TRAINING:
        raise TrainerUnavailable(
            f"megatron-core {compat.MCORE_VERSION_STRING} ships no megatron.training (Megatron-LM's trainer is in the "
            "wheel from 0.17, Python >= 3.12): install megatron-core==0.19.2 on Python 3.12, "
            f"or run this project's job ({PRETRAIN}; pretrain_gpt.py in a clone), which takes Megatron-LM's flags")


def use_this_backend() -> None:
    """Rebind the names through which Megatron-Core and Megatron-LM reach NVIDIA's Megatron-FSDP."""
    if not once("megatron_lm.backend"):
        return
    # Where the trainer picks the class; Megatron-Core's own name stays NVIDIA's, so ``unwrap_model`` does not see
    # through ours: its checkpoints then call our ``state_dict_for_save_checkpoint`` (global keys, DTensor pieces),
    # not the inner module's, whose parameters are only this rank's views.
    rebind("FullyShardedDataParallel", FullyShardedDataParallel, "megatron.training.models.dist_utils")
    rebind("megatron_FSDP", FullyShardedDataParallel, "megatron.training.training")
    import megatron.core.optimizer as core_optimizer
    from megatron.training import checkpointing, training

    factory = optimizer_factory(PATCHES.original(core_optimizer, "get_megatron_optimizer"))
    rebind("get_megatron_optimizer", factory, "megatron.core.optimizer", "megatron.training.training")
    import megatron.core.distributed as core_distributed

    rebind("finalize_model_grads", finalize_factory(PATCHES.original(core_distributed, "finalize_model_grads")),
           "megatron.core.distributed", "megatron.core.distributed.finalize_model_grads", "megatron.training.training")
    rebind("calc_params_l2_norm", params_norm_factory(PATCHES.original(training, "calc_params_l2_norm")),
           "megatron.training.training", "megatron.training.utils", "megatron.training.utils.common_utils")
    rebind("preprocess_fsdp_dtensor_state_dict",
           fsdp_dtensor_preprocess_factory(PATCHES.original(checkpointing, "preprocess_fsdp_dtensor_state_dict")),
           "megatron.training.checkpointing")
    rebind("load_checkpoint", _refusing_job_checkpoints(PATCHES.original(checkpointing, "load_checkpoint")),
           "megatron.training.checkpointing", "megatron.training.training")


def _refusing_job_checkpoints(original):
    """``load_checkpoint`` that first stops, with one line naming the converter, on a checkpoint of this project's
    own ``pretrain_gpt.py`` (DCP would fail on its missing ``args`` entry, once per rank)."""
    @functools.wraps(original)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        load_dir = getattr(margs, load_arg, None)
        problem = load_dir and job_checkpoint_in_megatron_lm(load_dir, getattr(margs, "ckpt_step", None))
        if problem:
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                print(f"error: {problem}", file=sys.stderr, flush=True)
            sys.exit(1)
        return original(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
    return load_checkpoint


def install() -> None:
    """Make ``--use-megatron-fsdp`` in Megatron-LM's trainer mean this backend (and run on CPU without CUDA).

    Idempotent; composes with an already enabled CPU mode. ``uninstall()`` undoes it.
    """
    require_megatron_training()
    use_shipped_dataset_helpers()
    use_this_backend()
    if not torch.cuda.is_available():
        from megatron.fsdp.mcore_cpu.trainer_bridges import install_megatron_training

        install_megatron_training()


def uninstall() -> None:
    """Undo ``install()`` (and the trainers' CPU bridges; CPU mode itself: ``cpu_mode.disable_cpu_mode``)."""
    PATCHES.restore()


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m megatron.fsdp.mcore.megatron_lm SCRIPT [ARGS...]``: run SCRIPT as ``__main__`` after ``install()``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        sys.exit("usage: torchrun ... -m megatron.fsdp.mcore.megatron_lm PATH/pretrain_gpt.py [Megatron-LM flags]")
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        sys.exit(f"error: {argv[0]}: no such script (the Megatron-LM training script to run, e.g. pretrain_gpt.py)")
    try:
        install()
    except TrainerUnavailable as error:
        sys.exit(f"error: {error}")
    sys.argv = [script] + argv[1:]
    sys.path.insert(0, os.path.dirname(script))  # the script's own imports (gpt_builders, model_provider)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
