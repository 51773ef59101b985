"""Scalars for TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``).

Rank 0 writes them, under Megatron-LM's scalar names (``lm loss``, ``learning-rate``,
``grad-norm``, ``batch-size``, ``iteration-time``, ``throughput``,
``mem-max-allocated-bytes``, ``lm loss validation``, ``<timer>-time``), with the same
values the iteration line prints. Both packages are optional: asking for a writer whose
package is missing stops the job at start-up (``arguments/logging_flags.py``'s ``validate_writers``,
before any process group exists) with the ``pip install`` that fixes it, instead of a traceback
after the model is built.

wandb logs offline, into ``--wandb-save-dir``, unless ``WANDB_API_KEY`` or ``WANDB_MODE``
says otherwise (``wandb sync <dir>`` uploads an offline run later): a job on a machine
without network access must not wait for a login.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch.distributed as dist

from .logging_config import LoggingConfig


class ScalarWriters:
    """TensorBoard and wandb writers of rank 0 (no-ops elsewhere, or when neither is asked for)."""

    def __init__(self, config: LoggingConfig):
        self.tensorboard = self.wandb = None
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=1000)
        if config.wandb_project:
            self.wandb = _wandb_run(config)

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def scalars(self, iteration: int, values: Dict[str, Optional[float]]) -> None:
        values = {k: float(v) for k, v in values.items() if v is not None}
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, iteration)
        if self.wandb is not None and values:
            self.wandb.log(values, step=iteration)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _wandb_run(config: LoggingConfig):
    import wandb

    save_dir = config.wandb_save_dir or os.path.join(config.save or os.getcwd(), "wandb")  # Megatron-LM: --save/wandb
    os.makedirs(save_dir, exist_ok=True)
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    if mode == "offline":
        print(f"> wandb: logging offline to {save_dir} (no WANDB_API_KEY; `wandb sync` uploads it later)",
              flush=True)
    return wandb.init(project=config.wandb_project, name=config.wandb_exp_name, dir=save_dir,
                      config=dict(config.wandb_config),
                      mode=mode, settings=wandb.Settings(console="off", x_disable_stats=True))
