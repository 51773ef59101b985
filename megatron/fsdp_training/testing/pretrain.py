"""``pretrain_gpt``'s training function run inside a Megatron pool (no new processes), observed by a recorder."""

from __future__ import annotations

import contextlib
import io
from typing import List, Optional

from megatron.fsdp.mcore_cpu.fp8_linears import FP8_STATE
from megatron.fsdp_training.trainer import StepResult, TrainingObserver

FP8_SCALES = tuple(name for name in FP8_STATE if name.endswith("_scale"))  # the layers' delayed-scaling scales


def _named_buffers(model, keep) -> dict:
    """Every model chunk's buffers whose name ``keep(name)`` accepts, on this rank, by chunk and name."""
    from megatron.core.utils import get_attr_wrapped_model

    found = {}
    for index, chunk in enumerate(model):
        gpt = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
        for name, buffer in gpt.named_buffers():
            if keep(name):
                found[f"{index}/{name}"] = buffer.detach().cpu().tolist()
    return found


class HistoryRecorder(TrainingObserver):
    """What the tests compare between runs: per-iteration losses and grad norms, validation losses, the loaded
    iteration and the validation right after it, and at the end the routers' expert biases and the FP8 layers'
    delayed-scaling scales (the state a resume must restore)."""

    def __init__(self):
        self.history = {"losses": [], "grad_norms": [], "valid": [], "start_iteration": 0, "valid_at_load": None}

    def loaded(self, trainer, iteration: int, valid_loss: Optional[float]) -> None:
        self.history.update(start_iteration=iteration, valid_at_load=valid_loss)

    def stepped(self, trainer, step: StepResult) -> None:
        self.history["losses"].append(step.losses["lm loss"])
        self.history["grad_norms"].append(step.grad_norm)
        for name, value in step.losses.items():
            if name != "lm loss":
                self.history.setdefault(name, []).append(value)

    def validated(self, trainer, iteration: int, loss: float) -> None:
        self.history["valid"].append(loss)

    def finished(self, trainer, iterations: int, max_peak_mib: float) -> None:
        self.history.update(
            iterations=iterations, max_peak_mib=max_peak_mib,
            expert_bias=_named_buffers(trainer.model, lambda name: name.endswith("expert_bias")),
            fp8_scales=_named_buffers(trainer.model, lambda name: name.rsplit(".", 1)[-1] in FP8_SCALES))


def pretrain_in_pool(ctx, argv: List[str], capture_log: bool = False) -> dict:
    """``pretrain(parse_args(argv))`` on the whole pool: rank's recorded history; ``capture_log``: also rank 0's
    printed log (``"log"``), the lines a torchrun launch would print."""
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.training import pretrain
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    log, recorder = io.StringIO(), HistoryRecorder()
    with megatron_case(), (contextlib.redirect_stdout(log) if capture_log else contextlib.nullcontext()):
        pretrain(parse_args(argv), observers=[recorder])
    return dict(recorder.history, log=log.getvalue()) if capture_log else recorder.history
