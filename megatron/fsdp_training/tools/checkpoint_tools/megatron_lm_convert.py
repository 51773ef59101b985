"""Between this project's job's checkpoints and Megatron-LM's trainer's, both ``fsdp_dtensor`` with megatron.fsdp.

    megatron-fsdp-convert to-megatron-lm CKPT SAVE_DIR     # pretrain_gpt.py -> Megatron-LM's trainer
    megatron-fsdp-convert from-megatron-lm CKPT SAVE_DIR   # Megatron-LM's trainer -> pretrain_gpt.py

The two hold the same tensors under the same keys (``model.<global key>``, ``optimizer.state.<key>.<moment>``,
``optimizer.param_groups.<g>.*``, ``optimizer.state_initialized``: the adapter writes both). They differ in where the
rest lives: this project's job keeps the arguments, iteration and LR schedule in ``common.json`` (with a checksum
manifest), Megatron-LM's trainer keeps ``args``, ``iteration``, ``checkpoint_version`` and ``opt_param_scheduler``
inside the DCP files. RNG states convert too: this job keeps one record per rank (``rng.rank<r>``), Megatron-LM's
trainer one per (pipeline, tensor) rank pair, taken from data-parallel rank 0 and given to every data-parallel rank
(without ``--data-parallel-random-init``, which is refused here). docs/trainers.md.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

# Megatron-LM's checkpoint version of a global (fsdp_dtensor) checkpoint, as its ``generate_state_dict`` writes.
MEGATRON_LM_CHECKPOINT_VERSION = 3.0


def _rank(layout: Dict[str, Any], pp: int, tp: int, dp: int = 0) -> int:
    """Megatron's global rank of (pipeline, tensor, data) ranks, context rank 0 (order tp-cp-dp-pp)."""
    tp_size, cp_size = int(layout.get("tensor_model_parallel_size") or 1), int(layout.get("context_parallel_size") or 1)
    return tp + tp_size * cp_size * (dp + int(layout["data_parallel_size"]) * pp)


def _pairs(layout: Dict[str, Any]):
    return [(pp, tp) for pp in range(int(layout.get("pipeline_model_parallel_size") or 1))
            for tp in range(int(layout.get("tensor_model_parallel_size") or 1))]


def rng_to_megatron_lm(rng: Dict[str, bytes], layout: Dict[str, Any]) -> Dict[str, Any]:
    """This job's per-rank RNG records as Megatron-LM's ``rng_state`` (``{"(pp, tp)": [state]}``)."""
    import pickle

    import torch

    from megatron.fsdp_training.checkpointing.portable_state import as_tensor

    out = {}
    for pp, tp in _pairs(layout):
        record = pickle.loads(rng[f"rank{_rank(layout, pp, tp)}"])
        cuda = as_tensor(record["cuda"])
        out[f"({pp}, {tp})"] = [{
            "random_rng_state": record["python"], "np_rng_state": record["numpy"],
            "torch_rng_state": as_tensor(record["torch"]),
            # a CPU run has no device generator: its CPU stand-in's fresh state (mcore_cpu/trainer_bridges.py)
            "cuda_rng_state": cuda if cuda is not None else torch.Generator().get_state(),
            "rng_tracker_states": {k: as_tensor(v) for k, v in (record["tracker"] or {}).items()}}]
    return out


def rng_from_megatron_lm(rng_state: Dict[str, Any], layout: Dict[str, Any]) -> Dict[str, bytes]:
    """Megatron-LM's ``rng_state`` as this job's per-rank records (every data-parallel rank gets its pair's)."""
    import pickle

    from megatron.fsdp_training.checkpointing.portable_state import portable

    out = {}
    for pp, tp in _pairs(layout):
        state = rng_state[f"({pp}, {tp})"][0]
        blob = pickle.dumps(portable({
            "python": state["random_rng_state"], "numpy": state["np_rng_state"],
            "torch": state["torch_rng_state"], "cuda": state["cuda_rng_state"],
            "tracker": dict(state["rng_tracker_states"]) or None}))
        for dp in range(int(layout["data_parallel_size"])):
            out[f"rank{_rank(layout, pp, tp, dp)}"] = blob
    return out


def _refuse_random_init(data_parallel_random_init: bool) -> None:
    if data_parallel_random_init:
        raise SystemExit("error: --data-parallel-random-init checkpoints keep an RNG state per data-parallel rank in "
                         "Megatron-LM's layout; this converter moves one per (pipeline, tensor) rank: not converted")


def _save(state: Dict[str, Any], tmp: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)


def to_megatron_lm(source: str, out: str, iteration: Optional[int] = None, overwrite: bool = False) -> Path:
    """This job's checkpoint as one Megatron-LM's trainer loads (``--load SAVE_DIR`` with ``--use-megatron-fsdp``)."""
    from . import output
    from . import source as checked
    from .convert import read_checkpoint

    directory, common = checked.tp_global_fsdp_dtensor(source, iteration)
    state = read_checkpoint(directory)
    rng = state.pop("rng", None)
    it = int(common["iteration"])
    args = argparse.Namespace(**common["args"])
    _refuse_random_init(getattr(args, "data_parallel_random_init", False))
    if rng:
        state["rng_state"] = rng_to_megatron_lm(rng, common["parallel_layout"])
    else:
        print("  the checkpoint has no RNG states (converted without them?): load it with --no-load-rng")
    args.iteration, args.consumed_train_samples = it, int(common.get("consumed_train_samples", 0))
    state.update(args=args, iteration=it, checkpoint_version=MEGATRON_LM_CHECKPOINT_VERSION,
                 opt_param_scheduler=common.get("scheduler"), num_floating_point_operations_so_far=0)
    root, tmp = output.destination(out, it, overwrite)
    _save(state, tmp)
    return output.publish(tmp, root, it, source=checked.fsdp_dtensor_record(directory))


def job_arguments(recorded: Mapping[str, Any]) -> argparse.Namespace:
    """Megatron-LM's validated arguments in this job's conventions, where the two write the same model differently:
    no grouped-query attention is ``num_query_groups`` None here (Megatron-LM sets the head count); with
    ``add_bias_linear`` the QKV bias follows it (Megatron-LM also sets ``add_qkv_bias``); Megatron-LM 0.19's
    NullTokenizer has exactly ``--vocab-size`` entries (this job's, as older Megatron-LM, one more).
    ``recorded``: the checkpoint's ``args`` as a mapping (``vars`` of its namespace)."""
    values = dict(recorded)
    if not values.get("group_query_attention"):
        values["num_query_groups"] = None
    if values.get("add_bias_linear"):
        values["add_qkv_bias"] = False
    if values.get("tokenizer_type") == "NullTokenizer":
        values["true_vocab_size"] = values.get("vocab_size")
    return argparse.Namespace(**values)


def from_megatron_lm(source: str, out: str, iteration: Optional[int] = None, overwrite: bool = False) -> Path:
    """A checkpoint of Megatron-LM's trainer with this backend as one this project's ``pretrain_gpt.py --load`` takes."""
    from megatron.fsdp_training.checkpointing import files
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from . import output
    from . import source as checked
    from .convert import read_checkpoint
    from .inspect import resolve

    from megatron.fsdp.mcore.trainer_checkpoints import MEGATRON_LM_ENTRIES, is_megatron_lm_checkpoint

    directory = resolve(source, iteration)
    if not is_megatron_lm_checkpoint(directory):
        raise SystemExit(f"error: {directory}: not a checkpoint of Megatron-LM's trainer (its DCP metadata has no "
                         f"{', '.join(MEGATRON_LM_ENTRIES)} entries)")
    state = read_checkpoint(directory)
    args, it = job_arguments(vars(state["args"])), int(state["iteration"])
    if "model" not in state or not any(k.startswith("decoder.") or k.startswith("embedding.") for k in state["model"]):
        raise SystemExit(f"error: {directory}: its model keys are not megatron.fsdp's global keys (a checkpoint of "
                         "NVIDIA's Megatron-FSDP or Megatron-Core DDP?): only checkpoints written with "
                         "megatron.fsdp behind --use-megatron-fsdp convert")
    _refuse_random_init(getattr(args, "data_parallel_random_init", False))
    tensors = {k: state[k] for k in ("model", "optimizer") if k in state}
    layout = {name: getattr(args, name, None) for name in checkpointing.PARALLEL_ARGS}
    world = int(args.world_size)
    layout.update(world_size=world, data_parallel_size=int(args.data_parallel_size))
    rng = rng_from_megatron_lm(state["rng_state"], layout) if "rng_state" in state else {}
    if rng:
        tensors["rng"] = rng
    root, tmp = output.destination(out, it, overwrite)
    _save(tensors, tmp)
    files.write_common(tmp, {
        "format": checkpointing.FORMAT, "version": checkpointing.VERSION, "iteration": it,
        "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
        # the RNG states are those of this world size's ranks (a load at another says so and skips them)
        "world_size": world if rng else None, "converted_rng": bool(rng),
        "converted_from": "Megatron-LM's trainer (megatron.training)",
        "scheduler": state.get("opt_param_scheduler"), "model_args": checkpointing.model_args(vars(args)),
        "parallel_layout": {k: checkpointing._json_value(v) for k, v in layout.items()},
        "args": {k: checkpointing._json_value(v) for k, v in sorted(vars(args).items())}})
    return output.publish(tmp, root, it, source=checked.megatron_lm_record(directory))
