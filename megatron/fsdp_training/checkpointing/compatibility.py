"""What a checkpoint must agree with on the command line before it loads.

The arguments that fix parameter shapes (``MODEL_SHAPE_ARGS``) and the model's numerics
(``MODEL_NUMERIC_ARGS``) are recorded in every checkpoint; one that differs stops the load with
a line naming each difference (``save_load.check_model_args`` for ``fsdp_dtensor``,
``torch_dist._check_model`` for the Megatron-Core baseline's format). The learning-rate and
weight-decay schedule follows Megatron-LM's rule (``scheduler_problem``, ``load_scheduler``).
One module, so that both formats read the same lists and rules without importing each other.

Free to change at load (documented in docs/checkpoints.md): the parallel layout, batch split
(``--micro-batch-size``), data, logging, evaluation, save and fault-tolerance arguments.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional

# Arguments that fix parameter shapes: a checkpoint saved with other values cannot load.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
                    "max_position_embeddings", "true_vocab_size", "padded_vocab_size", "num_experts",
                    "moe_ffn_hidden_size", "untie_embeddings_and_output_weights", "add_bias_linear",
                    "moe_grouped_gemm",
                    # DeepSeek-V3 shapes: multi-latent attention's projections, the MTP layers, which layers
                    # are MoE, and the router's expert-bias buffer.
                    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                    "v_head_dim", "mtp_num_layers", "moe_layer_freq", "moe_router_enable_expert_bias")
# Arguments that change what the same weights compute (compared from common.json's "args", where every
# argument is recorded, so checkpoints written before this list existed are compared too).
# (--rotary-base and --rotary-percent stay free: context extension changes them on purpose.)
MODEL_NUMERIC_ARGS = ("norm_epsilon", "normalization", "position_embedding_type", "swiglu", "qk_layernorm",
                      "num_query_groups", "group_query_attention", "add_qkv_bias")
# Arguments that changed checkpoint keys in layout version 1 (tensor-parallel shards stored per TP rank): recorded,
# free to change at load.
KEY_LAYOUT_ARGS = ("tensor_model_parallel_size", "expert_tensor_parallel_size")

OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"
# Megatron-Core's OptimizerParamScheduler state, in its own names and units (steps count samples), with the
# flags that set each value and the older names its load_state_dict also reads.
SCHEDULER_FIELDS = (
    ("max_lr", "--lr", ("start_lr",)),
    ("min_lr", "--min-lr", ()),
    ("lr_warmup_steps", "samples: --lr-warmup-iters x --global-batch-size, --lr-warmup-samples or "
                        "--lr-warmup-fraction", ("warmup_iter", "warmup_steps")),
    ("lr_decay_steps", "samples: --lr-decay-iters (default --train-iters) x --global-batch-size, or "
                       "--lr-decay-samples", ("end_iter", "decay_steps")),
    ("lr_decay_style", "--lr-decay-style", ("decay_style",)),
    ("start_wd", "--start-weight-decay or --weight-decay", ()),
    ("end_wd", "--end-weight-decay or --weight-decay", ()),
    ("wd_incr_style", "--weight-decay-incr-style", ()),
    ("wd_incr_steps", "samples: --train-iters x --global-batch-size, or --train-samples", ()),
)


def _saved_value(saved: Mapping[str, Any], name: str, legacy) -> Any:
    for key in (name,) + tuple(legacy):
        if key in saved:
            return saved[key]
    return None


def _constant_wd(saved: Mapping[str, Any], scheduler) -> bool:
    """Constant weight decay ignores ``wd_incr_steps``: its length may change (extending a run), unlike
    Megatron-LM, whose assertion would stop every run extended with a longer ``--train-iters``."""
    return saved.get("wd_incr_style", "constant") == "constant" and scheduler.wd_incr_style == "constant"


def _constant_lr(saved: Mapping[str, Any], scheduler) -> bool:
    """A constant learning rate after warm-up ignores ``lr_decay_steps``: extending such a run changes nothing."""
    style = _saved_value(saved, "lr_decay_style", ("decay_style",))
    return style == "constant" and scheduler.lr_decay_style == "constant"


def _ignored(name: str, saved: Mapping[str, Any], scheduler) -> bool:
    return ((name == "wd_incr_steps" and _constant_wd(saved, scheduler))
            or (name == "lr_decay_steps" and _constant_lr(saved, scheduler)))


def scheduler_differences(saved: Mapping[str, Any], scheduler) -> List[str]:
    """Each schedule value of the checkpoint (``saved``: ``OptimizerParamScheduler.state_dict()``) that differs
    from ``scheduler``'s, built from this command line: ``'name X in the checkpoint, Y now (flags)'``."""
    diffs = []
    for name, source, legacy in SCHEDULER_FIELDS:
        value = _saved_value(saved, name, legacy)
        if value is None or _ignored(name, saved, scheduler):
            continue
        now = getattr(scheduler, name)
        if value != now:
            diffs.append(f"{name} {value!r} in the checkpoint, {now!r} now ({source})")
    return diffs


def scheduler_problem(saved: Mapping[str, Any], scheduler, directory) -> Optional[str]:
    """Megatron-LM's rule as one line: without either flag, a schedule differing from the checkpoint's stops
    the load (Megatron-Core's ``_check_and_set`` would assert; without it the checkpoint's values won silently)."""
    if not saved or scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return None
    diffs = scheduler_differences(saved, scheduler)
    if not diffs:
        return None
    return (f"checkpoint {directory} was saved with another learning-rate schedule: " + "; ".join(diffs)
            + f"; pass {OVERRIDE_FLAG} to train with this command line's schedule, or {USE_CHECKPOINT_FLAG} "
            "to keep the checkpoint's")


def lr_bounds(optimizer) -> List[tuple]:
    """Each param group's ``max_lr`` and ``min_lr`` (set from this command line) before a load replaces them."""
    return [(group.get("max_lr"), group.get("min_lr")) for group in optimizer.param_groups]


def load_scheduler(saved: Mapping[str, Any], scheduler, optimizer, bounds: List[tuple]) -> None:
    """Load the schedule after ``scheduler_problem`` passed; call after the optimizer's state was loaded.

    ``--override-opt_param-scheduler`` also puts back the param groups' lr bounds of this command line
    (``bounds``; the optimizer's state carries the checkpoint's), as Megatron-LM's load does.
    """
    state = dict(saved)
    if not scheduler.use_checkpoint_opt_param_scheduler:  # what the comparison ignored takes this run's value
        for name, _, legacy in SCHEDULER_FIELDS:
            if _ignored(name, saved, scheduler):
                for key in (name,) + tuple(legacy):
                    state.pop(key, None)
                state[name] = getattr(scheduler, name)
    if scheduler.override_opt_param_scheduler:
        for group, (max_lr, min_lr) in zip(optimizer.param_groups, bounds):
            for key, value in (("max_lr", max_lr), ("min_lr", min_lr)):
                if value is not None:
                    group[key] = value
    scheduler.load_state_dict(state)


def numeric_differences(saved_args: Mapping[str, Any], now: Mapping[str, Any]) -> List[str]:
    """``MODEL_NUMERIC_ARGS`` recorded in ``saved_args`` (the checkpoint's arguments) that differ in ``now`` (this
    run's)."""
    return [f"--{name.replace('_', '-')} {saved_args[name]!r} in the checkpoint, {now[name]!r} now"
            for name in MODEL_NUMERIC_ARGS if name in saved_args and name in now and saved_args[name] != now[name]]


def weights_only_suffix(finetune: bool, purpose: Optional[str] = None) -> str:
    """What both formats' load line adds when only the weights are taken (``--finetune``): why.

    A tool that loads weights only for its own purpose names it (``tools/generate.py`` sets
    ``args.weights_only_purpose = "generation"``), so its log does not say fine-tuning.
    """
    if not finetune:
        return ""
    return f" for {purpose or 'fine-tuning'}"
