"""What the job's logs read of the arguments (``LoggingConfig``), built once after set-up.

Megatron-LM's flags of the same names; ``arguments/logging_flags.py`` declares and checks them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch


def uses_torch_profiler(profile: bool, use_pytorch_profiler: bool) -> bool:
    """``--profile`` records with ``torch.profiler``: asked for, or no CUDA profiler to start without CUDA."""
    return profile and (use_pytorch_profiler or not torch.cuda.is_available())


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """The scalar writers (TensorBoard, wandb), what the iteration line and the board add, and the profiler window."""

    tensorboard_dir: Optional[str]
    wandb_project: Optional[str]
    wandb_exp_name: Optional[str]
    wandb_save_dir: Optional[str]
    save: Optional[str]  # wandb's directory defaults to --save/wandb, as Megatron-LM's
    wandb_config: Tuple[Tuple[str, object], ...]  # the run's arguments as wandb records them (plain values only)
    log_throughput: bool
    log_params_norm: bool
    log_num_zeros_in_grad: bool
    log_timers_to_tensorboard: bool
    log_memory_to_tensorboard: bool
    log_validation_ppl_to_tensorboard: bool
    profile: bool
    use_pytorch_profiler: bool
    profile_ranks: Tuple[int, ...]
    profile_step_start: int
    profile_step_end: int

    @classmethod
    def from_args(cls, args) -> "LoggingConfig":
        """Read after set-up: wandb records the arguments as set-up left them (the padded vocabulary, say)."""
        plain = tuple((k, v) for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None))))
        names = {f.name for f in dataclasses.fields(cls)} - {"wandb_config", "profile_ranks"}
        return cls(wandb_config=plain, profile_ranks=tuple(args.profile_ranks or ()),
                   **{name: getattr(args, name) for name in names})

    @property
    def uses_torch_profiler(self) -> bool:
        return uses_torch_profiler(self.profile, self.use_pytorch_profiler)
