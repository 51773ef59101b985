"""What Megatron-LM's loop does around each iteration for its memory, time and logging flags.

``--manual-gc`` / ``--manual-gc-interval``: Python's threshold collector off, a collection at
the start, around each evaluation and every N iterations, so every rank pauses at the same
step. ``--empty-unused-memory-level``: ``torch.cuda.empty_cache()`` after forward-backward (1)
and after the optimizer step too (2). ``--exit-duration-in-mins``: after each iteration the
ranks agree (a MAX all-reduce) whether that long has passed since start-up on any; the loop then saves (with
``--save``) and stops. ``--log-num-zeros-in-grad`` / ``--log-params-norm`` add Megatron-LM's
``num zeros`` and ``params norm`` fields to the iteration line and the board;
``--log-memory-to-tensorboard`` and ``--log-validation-ppl-to-tensorboard`` its scalars.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from .logs.logging_config import LoggingConfig


class LoopControls:
    def __init__(self, config, start: float):
        """``config``: the loop's ``trainer.LoopConfig`` (``manual_gc``, ``manual_gc_interval``,
        ``empty_unused_memory_level``, ``exit_duration_in_mins``); ``start``: the job's ``time.perf_counter()`` at
        start-up (the exit duration counts from it)."""
        self.config = config
        self.start = start
        if config.manual_gc:
            gc.disable()
            gc.collect()

    def after_forward_backward(self) -> None:
        if self.config.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def after_step(self, iteration: int) -> None:
        c = self.config
        if c.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if c.manual_gc and c.manual_gc_interval and iteration % c.manual_gc_interval == 0:
            gc.collect()

    def around_evaluation(self) -> None:
        if self.config.manual_gc:
            gc.collect()

    def out_of_time(self) -> bool:
        """True on every rank once any rank has trained ``--exit-duration-in-mins`` (a collective)."""
        if self.config.exit_duration_in_mins is None:
            return False
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        over = torch.tensor([(time.perf_counter() - self.start) / 60.0 > self.config.exit_duration_in_mins],
                            dtype=torch.int32, device=device)
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
        return bool(over.item())

    def close(self) -> None:
        if self.config.manual_gc:
            gc.enable()


def extra_fields(config: LoggingConfig, num_zeros, params_norm: Optional[float]) -> list:
    """``num zeros`` and ``params norm``, placed after ``grad norm`` as Megatron-LM prints them."""
    fields = []
    if config.log_num_zeros_in_grad:
        fields.append(("num zeros", "nan" if num_zeros is None else f"{int(num_zeros)}"))
    if params_norm is not None:
        fields.append(("params norm", f"{params_norm:.3f}"))
    return fields


def extra_scalars(config: LoggingConfig, num_zeros, params_norm: Optional[float], memory: dict) -> dict:
    out = {}
    if config.log_num_zeros_in_grad and num_zeros is not None:
        out["num-zeros"] = float(num_zeros)
    if params_norm is not None:
        out["params-norm"] = params_norm
    if config.log_memory_to_tensorboard:
        out["mem-allocated-bytes"] = memory["allocated"] * 2**20
        out["mem-max-allocated-bytes"] = memory["peak"] * 2**20
    return out


def validation_scalars(config: LoggingConfig, loss: float) -> dict:
    values = {"lm loss validation": loss}
    if config.log_validation_ppl_to_tensorboard:
        values["lm loss validation ppl"] = math.exp(min(20.0, loss))
    return values
