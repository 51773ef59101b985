"""FP8 scaling state in checkpoints: weights load whatever the loading run's precision.

Delayed scaling keeps amax histories and scales beside the weights (the CPU FP8 layers' buffers,
``megatron.fsdp.mcore_cpu.fp8_linears.FP8_STATE``; the engine's FP8 gather's per-parameter state,
``megatron.fsdp.sharding.quantized_gather``). They describe how a recipe scaled the weights, not
the weights: a run that switches FP8 off, on, or to another recipe or window at a resume (as
Megatron-LM allows with Transformer Engine), fine-tunes, generates or converts takes the weights
and leaves that state: kept where the recipe is the same, started fresh (or not read) otherwise,
in one line that says which. The decision reads only the arguments both runs record, so every
rank decides alike before any collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, List, Mapping, Optional, Tuple

from megatron.fsdp.mcore_cpu.fp8_linears import FP8_STATE as LAYER_STATE
from megatron.fsdp.sharding.quantized_gather import AMAX_HISTORY_KEY, SCALE_KEY

# The arguments that fix the shape and meaning of that state (common.json's "args"); the defaults are the parser's.
RECIPE_ARGS = (("fp8", None), ("fp8_recipe", "delayed"), ("fp8_amax_history_len", 1),
               ("fp8_amax_compute_algo", "most_recent"), ("fp8_margin", 0), ("first_last_layers_bf16", False),
               ("num_layers_at_start_in_bf16", 1), ("num_layers_at_end_in_bf16", 1))


def is_scaling_state(key: str) -> bool:
    """Whether a model key (with or without a ``model.`` prefix) is FP8 scaling state rather than a weight."""
    last = key.rsplit(".", 1)[-1]
    return last in LAYER_STATE or key.endswith(AMAX_HISTORY_KEY) or key.endswith(SCALE_KEY)


def weights_only(keys: Iterable[str]) -> List[str]:
    """``keys`` without FP8 scaling state."""
    return [k for k in keys if not is_scaling_state(k)]


def _recipe(values: Mapping[str, Any]) -> Tuple:
    # under --use-megatron-fsdp, --fp8-param-gather moves the weights' histories from the layers to the engine
    engine_gather = bool(values.get("fp8_param_gather") and values.get("use_megatron_fsdp"))
    return tuple(values.get(name, default) for name, default in RECIPE_ARGS) + (engine_gather,)


def describe(values: Mapping[str, Any]) -> str:
    """A run's FP8 in the flags' words: ``FP8 off`` or ``--fp8-format hybrid --fp8-recipe delayed (...)``."""
    if values.get("fp8") is None:
        return "FP8 off"
    recipe = values.get("fp8_recipe", "delayed")
    text = f"--fp8-format {values['fp8']} --fp8-recipe {recipe}"
    if recipe == "delayed":
        text += (f" --fp8-amax-history-len {values.get('fp8_amax_history_len', 1)} --fp8-amax-compute-algo "
                 f"{values.get('fp8_amax_compute_algo', 'most_recent')}")
    return text + (" --fp8-param-gather" if values.get("fp8_param_gather") else "")


def _has_state(values: Mapping[str, Any]) -> bool:
    return values.get("fp8") is not None and values.get("fp8_recipe", "delayed") == "delayed"


@dataclasses.dataclass(frozen=True)
class ScalingStatePlan:
    """What a load does with FP8 scaling state: ``load`` it (the same recipe), or not; ``line``: what to say."""

    load: bool
    line: Optional[str] = None


def plan(saved_args: Mapping[str, Any], saved_keys: Optional[Iterable[str]], now: Mapping[str, Any],
         directory) -> ScalingStatePlan:
    """The decision for loading ``directory`` (saved with ``saved_args``, holding ``saved_keys``; None: the job's
    own per-rank files, which hold what the arguments say) into a run of arguments ``now``. A checkpoint a converter
    wrote from an FP8 run's weights has that run's arguments and no state."""
    saved_state = _has_state(saved_args) and (saved_keys is None or any(is_scaling_state(k) for k in saved_keys))
    now_state = _has_state(now)
    if not saved_state and not now_state:
        return ScalingStatePlan(load=True)  # neither side has any: nothing to decide
    if saved_state and now_state and _recipe(saved_args) == _recipe(now):
        return ScalingStatePlan(load=True)
    was, is_ = describe(saved_args), describe(now)
    if not now_state:
        line = (f" checkpoint {directory} was saved with {was}, this run has {is_}: its FP8 amax histories and "
                "scales are not loaded (the weights are)")
    elif not saved_state and _has_state(saved_args):
        line = (f" checkpoint {directory} holds no FP8 amax histories (converted from a run with {was}): this "
                "run's start fresh")
    elif not saved_state:
        line = (f" checkpoint {directory} was saved with {was}, this run has {is_}: its FP8 amax histories and "
                "scales start fresh (the checkpoint has none)")
    else:
        line = (f" checkpoint {directory} was saved with {was}, this run has {is_}: the checkpoint's FP8 amax "
                "histories and scales are not loaded, this run's start fresh")
    return ScalingStatePlan(load=False, line=line)


def conversion_note(keys: Iterable[str], target: str) -> str:
    """What a converter says when it leaves FP8 scaling state behind ("" when there was none)."""
    left = [k for k in keys if is_scaling_state(k)]
    if not left:
        return ""
    return (f"not converted: {len(left)} FP8 amax histories and scales (delayed scaling's state, not weights; "
            f"{target})")
