"""Megatron-LM's ``--profile``: a window of iterations recorded for Perfetto / TensorBoard or Nsight.

``--use-pytorch-profiler`` (and ``--profile`` on a machine without CUDA, where there is no CUDA
profiler to start; said in the substitution line) records iterations
``--profile-step-start`` + 1 .. ``--profile-step-end`` with ``torch.profiler`` as Megatron-LM does
(``schedule(wait=start-1, warmup=1, active=end-start)``) and writes one Chrome trace per
profiled rank into ``--tensorboard-dir`` (``torch.profiler.tensorboard_trace_handler``): open it in
Perfetto (ui.perfetto.dev) or TensorBoard's profiler plugin. The engine's schedule shows in it
as named ranges ``fsdp.all_gather <unit>``, ``fsdp.reduce <unit>``, ``fsdp.wait.<kind> <unit>``
(megatron/fsdp/collectives/profiling.py). On CUDA, ``--profile`` alone starts and stops the CUDA
profiler over the same window (``nsys profile --capture-range=cudaProfilerApi``), where the
engine's ranges are NVTX ranges. The flags and their rules are ``arguments/logging_flags.py``'s.
"""

from __future__ import annotations

from typing import Optional

import torch

from .logs.logging_config import LoggingConfig


class Profiler:
    """Started before the first iteration, ``step()`` after each; a no-op unless this rank profiles."""

    def __init__(self, config: LoggingConfig, rank: int, start_iteration: int = 0):
        self.config = config
        self.on = config.profile and (not config.profile_ranks or rank in config.profile_ranks)
        self.torch: Optional[torch.profiler.profile] = None
        self.iteration = start_iteration
        if self.on and config.uses_torch_profiler:
            start, end = config.profile_step_start, config.profile_step_end
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=max(start - 1 - start_iteration, 0),
                                                 warmup=1 if start > start_iteration else 0,
                                                 active=end - max(start, start_iteration), repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(config.tensorboard_dir),
                record_shapes=True, with_stack=False)
            self.torch.start()

    def step(self) -> None:
        """After iteration ``self.iteration + 1``."""
        self.iteration += 1
        if not self.on:
            return
        if self.torch is not None:
            self.torch.step()
            if self.iteration >= self.config.profile_step_end:
                self.stop()
        elif self.iteration == self.config.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        elif self.iteration == self.config.profile_step_end:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())

    def stop(self) -> None:
        """End of training (or of the window): write the trace once."""
        if self.torch is not None:
            self.torch.stop()
            self.torch = None
