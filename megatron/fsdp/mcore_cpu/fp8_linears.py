"""Megatron-Core's local linear layers with FP8 GEMMs (no Transformer Engine), and their delayed-scaling state.

``Fp8ColumnParallelLinear`` / ``Fp8RowParallelLinear`` are ``ColumnParallelLinear`` /
``RowParallelLinear`` whose matrix multiply is ``fp8_matmul.Fp8Linear``; tensor and sequence
parallelism keep Megatron-Core's region functions around it (the input is gathered in the compute
dtype, then quantized). ``fp8_layer_spec`` puts them into a layer spec in place of every local
linear (attention, MLA's projections, MLP, experts, shared experts); the router, the embedding and
the output layer stay as they are, as in Megatron-Core's Transformer Engine layers.

The weight operand: under ``--fp8-param-gather`` with ``--use-megatron-fsdp`` the FP8 bytes and
scales of megatron.fsdp's quantized gather (``megatron.fsdp.quantized_weight``); otherwise the
layer quantizes its compute weight with the same ``megatron.fsdp.precision.fp8`` function.

Delayed scaling keeps, per layer, Transformer Engine's two histories: the forward one (input and,
unless the engine quantizes the weight, weight) and the backward one (output gradient), with their
scales, as persistent buffers (``fp8_forward_history`` ``[L, n]``, ``fp8_forward_scale`` ``[n]``,
``fp8_backward_history``, ``fp8_backward_scale``): checkpoints hold them. Training micro-batches
quantize with the current scales and record their amaxes (evaluation records nothing); once per
optimizer step ``Fp8StepEnd`` (installed around ``finalize_model_grads``) takes the max of the
recorded amaxes over Megatron-Core's amax-reduction group (tensor x data x context parallel, one
gather for all layers, through the engine's ledger) and advances every history (TE's roll and
scale rule, ``fp8.AmaxHistory.advance``). Transformer Engine advances after every micro-batch; once
per step makes the scales a function of the global batch, the same for any data-parallel size and
micro-batch split, and leaves activation recomputation exact (it records the same amax again).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Iterable, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.fsdp.collectives.comm import CommAxis, Ledger
from megatron.fsdp.precision import fp8

from .fp8_matmul import GRAD, INPUT, WEIGHT, Fp8Recipe, fp8_linear


FP8_STATE = ("fp8_forward_history", "fp8_forward_scale", "fp8_backward_history", "fp8_backward_scale")


class _Fp8Linear:
    """The FP8 part shared by both linears: the recipe, its state, and the GEMM in ``_forward_impl``."""

    def _init_fp8(self, recipe: Fp8Recipe) -> None:
        self.fp8_recipe = recipe
        self._fp8_recording = False
        if recipe.per_tensor or recipe.recipe == "mxfp8":
            self._check_blocks()
        if recipe.recipe != "delayed":
            return
        length, device = recipe.amax_history_len, self.weight.device
        forward = 1 if recipe.param_gather else 2  # the engine's gather keeps the weight's history itself
        self.register_buffer("fp8_forward_history", torch.zeros(length, forward, device=device))
        self.register_buffer("fp8_forward_scale", torch.ones(forward, device=device))
        self.register_buffer("fp8_backward_history", torch.zeros(length, 1, device=device))
        self.register_buffer("fp8_backward_scale", torch.ones(1, device=device))

    def _apply(self, fn, recurse=True):
        """Moves apply to the delayed-scaling state, casts do not: ``Float16Module``'s ``module.bfloat16()``
        (the baseline's bf16) would round the amax histories and scales."""
        state = {name: self._buffers.pop(name) for name in FP8_STATE if self._buffers.get(name) is not None}
        result = super()._apply(fn, recurse)
        for name, tensor in state.items():
            moved = fn(tensor)
            self._buffers[name] = moved if moved.dtype == tensor.dtype else tensor.to(device=moved.device)
        return result

    def _check_blocks(self) -> None:
        if self.fp8_recipe.recipe != "mxfp8":
            return
        rows, cols = self.weight.shape
        if rows % fp8.MX_BLOCK or cols % fp8.MX_BLOCK:
            raise ValueError(f"--fp8-recipe mxfp8: {type(self).__name__} of weight {rows} x {cols} (per tensor-parallel "
                             f"rank) has a dimension that is not a multiple of {fp8.MX_BLOCK}; choose widths that are")

    # -------------------------------------------------------------- operands
    def _slot(self, role: str):
        """(history buffer, scale buffer, column) of ``role`` under delayed scaling."""
        if role == GRAD:
            return self.fp8_backward_history, self.fp8_backward_scale, 0
        return self.fp8_forward_history, self.fp8_forward_scale, 0 if role == INPUT else 1

    def _quantize(self, role: str, tensor: torch.Tensor, dim: int) -> fp8.QuantizedWeight:
        recipe = self.fp8_recipe
        fmt = recipe.format_of(role)
        if recipe.recipe == "tensorwise":
            return fp8.quantize_tensorwise(tensor, fmt, recipe.margin)
        if recipe.recipe == "mxfp8":
            return fp8.quantize_mxfp8(tensor, fmt, dim)
        history, scale, column = self._slot(role)
        current = fp8.AmaxHistory(history[:, column], scale[column], recipe.amax_compute_algo)
        quantized, recorded = fp8.quantize_delayed(tensor, current, fmt)
        if self._fp8_recording:
            history[0, column] = recorded.amaxes[0]
        return quantized

    def _weight_operand(self, weight: torch.Tensor, dim: int) -> fp8.QuantizedWeight:
        """The weight in FP8 (mxfp8: blocked along ``dim``). With the engine's gather its bytes for the forward
        and per-tensor input gradients; mxfp8's input gradient needs blocks along the other dimension, quantized
        from the compute weight the engine built from those bytes."""
        if self.fp8_recipe.param_gather:
            gathered = _engine_quantized_weight(weight)
            if gathered is None:
                raise RuntimeError(f"--fp8-param-gather: megatron.fsdp holds no FP8 gather of {type(self).__name__}'s "
                                   "weight (is the model wrapped with the FP8 param_gather?)")
            if self.fp8_recipe.per_tensor or gathered.block_dim % weight.dim() == dim:
                return gathered
        return self._quantize(WEIGHT, weight, dim)

    # -------------------------------------------------------------- the GEMM
    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **_unused):
        if gradient_accumulation_fusion:
            raise RuntimeError("FP8 layers accumulate weight gradients through autograd: use "
                               "--no-gradient-accumulation-fusion")
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        self._fp8_recording = self.training and torch.is_grad_enabled()
        return fp8_linear(input, weight, bias, self.fp8_recipe, self._quantize, self._weight_operand)

    # ---------------------------------------------------- delayed scaling
    def fp8_amaxes(self) -> List[torch.Tensor]:
        """This step's recorded amaxes (slot 0 of each history), in a fixed order."""
        return [self.fp8_forward_history[0], self.fp8_backward_history[0]]

    def fp8_advance(self, amaxes: List[torch.Tensor]) -> None:
        """Slot 0 := the reduced ``amaxes``, then each history's next scale and roll (``fp8.AmaxHistory.advance``)."""
        recipe = self.fp8_recipe
        for (history, scale), amax, role in zip(((self.fp8_forward_history, self.fp8_forward_scale),
                                                 (self.fp8_backward_history, self.fp8_backward_scale)),
                                                amaxes, (INPUT, GRAD)):
            history[0] = amax
            advanced = fp8.AmaxHistory(history, scale, recipe.amax_compute_algo).advance(
                recipe.format_of(role), recipe.margin)
            history.copy_(advanced.amaxes)
            scale.copy_(advanced.scale)


class Fp8ColumnParallelLinear(_Fp8Linear, ColumnParallelLinear):
    """``ColumnParallelLinear`` with FP8 GEMMs (module docstring)."""

    def __init__(self, *args, fp8_recipe: Fp8Recipe, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8(fp8_recipe)


class Fp8RowParallelLinear(_Fp8Linear, RowParallelLinear):
    """``RowParallelLinear`` with FP8 GEMMs (module docstring)."""

    def __init__(self, *args, fp8_recipe: Fp8Recipe, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8(fp8_recipe)


def _engine_quantized_weight(param: torch.Tensor) -> Optional[fp8.QuantizedWeight]:
    """megatron.fsdp's FP8 gather of ``param`` while its unit is gathered (None when the engine holds none)."""
    import megatron.fsdp as mfsdp

    return mfsdp.quantized_weight(param)


# ------------------------------------------------------------------ specs
_FP8_CLASSES = {ColumnParallelLinear: Fp8ColumnParallelLinear, RowParallelLinear: Fp8RowParallelLinear}


def fp8_layer_spec(spec, recipe: Fp8Recipe):
    """A copy of a layer spec with every local linear (a ``ColumnParallelLinear`` / ``RowParallelLinear``
    submodule at any depth) replaced by its FP8 class, built with ``recipe``."""
    spec = copy.deepcopy(spec)
    _replace_linears(spec, recipe)
    return spec


def _submodules(spec):
    """The submodules dataclass a spec entry holds: a ``ModuleSpec``'s, or (megatron-core >= 0.17, whose
    local spec gives the MLP as ``functools.partial(MLP.as_mlp_submodule, submodules=...)``) a partial's."""
    if isinstance(spec, functools.partial):
        submodules = spec.keywords.get("submodules")
    else:
        submodules = getattr(spec, "submodules", None)
    return submodules if submodules is not None and dataclasses.is_dataclass(submodules) else None


def _replace_linears(spec, recipe: Fp8Recipe) -> None:
    submodules = _submodules(spec)
    if submodules is None:
        return
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        if isinstance(value, type) and value in _FP8_CLASSES:
            setattr(submodules, field.name, ModuleSpec(module=_FP8_CLASSES[value], params={"fp8_recipe": recipe}))
        elif isinstance(value, ModuleSpec):
            if value.module in _FP8_CLASSES:
                value.module = _FP8_CLASSES[value.module]
                value.params = {**value.params, "fp8_recipe": recipe}
            _replace_linears(value, recipe)
        elif isinstance(value, functools.partial):
            _replace_linears(value, recipe)


# ------------------------------------------------------- the step's end
def delayed_layers(chunks: Iterable[torch.nn.Module]) -> List[_Fp8Linear]:
    """Every delayed-scaling FP8 layer of the model chunks, in module order (the same on every rank)."""
    return [m for chunk in chunks for m in chunk.modules()
            if isinstance(m, _Fp8Linear) and m.fp8_recipe.recipe == "delayed"]


class Fp8StepEnd:
    """Once per optimizer step: the max of every recorded amax over the amax-reduction group, then each
    layer's histories advance (module docstring). One all-gather of all layers' amaxes (they are >= 0, so
    the max over the gathered rows is the all-reduce MAX), recorded in ``ledger``."""

    def __init__(self, layers: List[_Fp8Linear], group=None, ledger: Optional[Ledger] = None):
        self.layers = layers
        self.ledger = ledger or Ledger()
        if group is None:
            group = parallel_state.get_amax_reduction_group(with_context_parallel=True)
        self.axis = CommAxis("amax", group, self.ledger)

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.layers:
            return
        pieces = [amax for layer in self.layers for amax in layer.fp8_amaxes()]
        sizes = [p.numel() for p in pieces]
        local = torch.cat([p.reshape(-1) for p in pieces]).to(torch.float32)
        gathered = torch.empty(self.axis.size * local.numel(), dtype=local.dtype, device=local.device)
        self.axis.all_gather(gathered, local, tag="fp8 amax").wait()
        reduced = gathered.view(self.axis.size, -1).amax(dim=0).split(sizes)
        for k, layer in enumerate(self.layers):
            layer.fp8_advance(list(reduced[2 * k:2 * k + 2]))


def install_step_end(config, chunks: List[torch.nn.Module]) -> Optional[Fp8StepEnd]:
    """Wrap ``config.finalize_model_grads_func`` (the schedules call it once per step, after the last
    backward) so delayed scaling advances there; nothing without delayed-scaling layers."""
    layers = delayed_layers(chunks)
    if not layers:
        return None
    step_end, finalize = Fp8StepEnd(layers), config.finalize_model_grads_func

    def finalize_then_advance(*args, **kwargs):
        result = finalize(*args, **kwargs)
        step_end()
        return result

    config.finalize_model_grads_func = finalize_then_advance
    return step_end
