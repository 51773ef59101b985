"""``FullyShardedDataParallel``: a drop-in for Megatron-Core's data-parallel wrappers.

Same constructor as ``megatron.core.distributed.DistributedDataParallel`` and the
same methods with the same meaning (``no_sync``, ``start_grad_sync``,
``finish_grad_sync``, ``scale_gradients``, ``zero_grad_buffer``,
``broadcast_params``); ``state_dict`` / ``load_state_dict`` give and take the
sharded form for ``torch.distributed.checkpoint`` under global keys
(``full_state_dict`` the full tensors); underneath, the
model chunk is wrapped by ``megatron.fsdp.fully_shard`` with
``TransformerLayer`` (and ``MoELayer``) instances as units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterable, Optional, Type

import torch

from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

import megatron.fsdp as mfsdp
from megatron.fsdp.checkpoint.state_dict import expected_model_keys
from megatron.fsdp.collectives.simulation import is_fake
from megatron.fsdp.init.meta_init import is_on_meta
from megatron.fsdp.sharding.strategy import parse_mesh_strategy, parse_strategy
from megatron.fsdp.warn_once import warn_once

from megatron.fsdp import mcore_releases as compat
from . import ddp_fields
from .checkpoint_keys import CheckpointKeys, ParallelRanks, chunk_keys, split_rules, tp_placements
from .distributed_index import FSDPDistributedIndex
from .finalize import refuse_megatron_core_finalize
from .fp8_gather import fp8_param_gather
from .meta_build import recipe_of
from .overlap import overlap_arguments

logger = logging.getLogger(__name__)

DEFAULT_UNIT_CLASSES = (TransformerLayer, MoELayer)

@dataclasses.dataclass
class FullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """Megatron-Core's DDP config plus the expert section's own levels (``None``: as the dense ones).

    A plain ``DistributedDataParallelConfig`` works too: the expert fields then
    take the dense values. ``megatron_fsdp_main_params_dtype`` is Megatron-Core's field (from 0.19,
    declared here for earlier releases, same default): the dtype of the main weights the optimizer
    updates; ``None``: the compute weights are the main weights (Megatron-Core's meaning).
    """

    expert_data_parallel_sharding_strategy: Optional[str] = None
    expert_outer_dp_sharding_strategy: Optional[str] = None
    expert_num_distributed_optimizer_instances: Optional[int] = None
    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = torch.float32


@dataclasses.dataclass(frozen=True)
class ExpertLevels:
    inner: str
    outer: str
    instances: int


def expert_levels(ddp_config: DistributedDataParallelConfig) -> ExpertLevels:
    """The expert section's (inner level, outer level, instances); unset fields follow the dense ones."""
    inner = getattr(ddp_config, "expert_data_parallel_sharding_strategy", None)
    outer = getattr(ddp_config, "expert_outer_dp_sharding_strategy", None)
    instances = getattr(ddp_config, "expert_num_distributed_optimizer_instances", None)
    instances = instances or ddp_config.num_distributed_optimizer_instances
    if outer is None:
        outer = ddp_config.outer_dp_sharding_strategy if instances > 1 else "no_shard"
    return ExpertLevels(inner or ddp_config.data_parallel_sharding_strategy, outer, instances)


def _check_mesh_levels(inner: str, outer: str, instances: int, what: str) -> None:
    if instances < 1:
        raise ValueError(f"{what}num_distributed_optimizer_instances must be >= 1, got {instances}")
    parse_strategy(inner)
    if instances > 1:
        parse_mesh_strategy(inner, outer, has_outer_axis=True)
    elif outer != "no_shard":
        raise ValueError(f"{what}outer_dp_sharding_strategy={outer!r} needs an outer axis: set "
                         f"{what}num_distributed_optimizer_instances > 1"
                         + ("" if what else " (and pass it to parallel_state.initialize_model_parallel)"))


def reject_fp16(config) -> None:
    """The one fp16 rule, for the model's ``TransformerConfig`` and the ``OptimizerConfig`` alike."""
    if getattr(config, "fp16", False):
        raise ValueError("fp16 needs loss scaling, which megatron.fsdp does not implement; use bf16")


def check_configs(config: TransformerConfig, ddp_config: DistributedDataParallelConfig, dp_size: int = 1) -> None:
    """Reject what cannot work and say how to fix it, before any collective."""
    if not ddp_config.use_megatron_fsdp:
        raise ValueError("FullyShardedDataParallel needs DistributedDataParallelConfig(use_megatron_fsdp=True); "
                         "for plain data parallelism use megatron.core.distributed.DistributedDataParallel")
    _check_mesh_levels(ddp_config.data_parallel_sharding_strategy, ddp_config.outer_dp_sharding_strategy,
                       ddp_config.num_distributed_optimizer_instances, "")
    experts = expert_levels(ddp_config)
    _check_mesh_levels(experts.inner, experts.outer, experts.instances, "expert_")
    reject_fp16(config)
    if getattr(config, "gradient_accumulation_fusion", False):
        raise ValueError("gradient_accumulation_fusion=True writes weight grads into param.main_grad, which "
                         "megatron.fsdp replaces with flat sharded buffers; set "
                         "gradient_accumulation_fusion=False (--no-gradient-accumulation-fusion)")
    refused = ddp_fields.refusal(ddp_config)
    if refused:
        raise ValueError(refused)
    missing = compat.finalize_features_not_supported(config)
    if missing:
        raise ValueError(f"TransformerConfig {', '.join(missing)}: megatron.fsdp's finalize_model_grads does not "
                         "run the gradient reductions these need (Megatron-Core's own DistributedDataParallel does); "
                         "leave them at their defaults")
    for line in ddp_fields.substitutions(ddp_config, dp_size):
        warn_once(line, stacklevel=2)


def mixed_precision(config: TransformerConfig, ddp_config: DistributedDataParallelConfig) -> mfsdp.MixedPrecision:
    """The engine's precision: compute in bf16 under ``config.bf16``; main weights in
    ``megatron_fsdp_main_params_dtype`` (fp32 by default; ``None``: the compute dtype); gradients reduced in
    fp32 with ``grad_reduce_in_fp32``, else in the compute dtype, unless ``megatron_fsdp_grad_comm_dtype`` says."""
    compute = torch.bfloat16 if config.bf16 else torch.float32
    main = getattr(ddp_config, "megatron_fsdp_main_params_dtype", torch.float32) or compute
    if main not in (torch.float32, torch.bfloat16):
        raise ValueError(f"megatron_fsdp_main_params_dtype={main}: megatron.fsdp keeps main weights in fp32 or bf16")
    if main == torch.bfloat16 and compute != torch.bfloat16:
        raise ValueError("megatron_fsdp_main_params_dtype=torch.bfloat16 needs bf16 compute (TransformerConfig.bf16)")
    return mfsdp.MixedPrecision(param_dtype=torch.bfloat16 if config.bf16 else None, main_dtype=main,
                                grad_reduce_dtype=ddp_fields.grad_comm_dtype(ddp_config, compute))


def _tied_embedding_units(module: torch.nn.Module):
    """With tied embeddings split over pipeline stages, the shared weight gets a unit of its own;
    so does the word embedding of the first stage and its copy on the multi-token prediction stage.

    Both stages then lay it out identically, so its gradient pieces line up
    across the embedding group and can be all-reduced shard by shard.
    """
    shared = getattr(module, "share_embeddings_and_output_weights", False)
    mtp = getattr(module, "mtp_process", False)  # the MTP stage keeps a copy of the word embedding
    if not (shared or getattr(getattr(module, "config", None), "mtp_num_layers", None)):
        return []
    pre, post = getattr(module, "pre_process", False), getattr(module, "post_process", False)
    if pre and (post or mtp):
        return []  # both on this chunk: one parameter, in the root unit
    if pre or mtp:
        return [module.embedding.word_embeddings]
    if post and shared:
        return [module.output_layer]
    return []


def meta_init_arguments(module: torch.nn.Module) -> dict:
    """``fully_shard``'s ``meta_init`` for a chunk built by ``build_on_meta_device`` (else nothing).

    The chunk is then materialised unit by unit and each submodule initialised by
    replaying what Megatron-Core's constructors did to it (``meta_build.py``).
    """
    if not is_on_meta(module):
        return {}
    recipe = recipe_of(module)
    if recipe is None:
        raise ValueError(f"{type(module).__name__} is on the meta device but was not built by "
                         "megatron.fsdp.mcore.build_on_meta_device(build), which records Megatron-Core's "
                         "initialisation so it can be replayed; build it that way "
                         "(pretrain_gpt.py: --init-model-with-meta-device)")
    late = recipe.out_of_order()
    if late:
        warn_once(f"meta-device initialisation: {late} draw random numbers out of module order in their "
                  "constructors; their weights will differ from an eager build's (still equal across DP sizes)", stacklevel=2)
    return dict(meta_init=mfsdp.MetaInit(init_weights=recipe.init_weights))


class FullyShardedDataParallel(_BaseDataParallel):
    def __init__(self, config: TransformerConfig, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 disable_bucketing: bool = False, pg_collection=None,
                 unit_classes: Iterable[Type[torch.nn.Module]] = DEFAULT_UNIT_CLASSES):
        super().__init__(config=config, module=module)
        instances = ddp_config.num_distributed_optimizer_instances
        experts = expert_levels(ddp_config)
        if pg_collection is None:  # the groups' handles and sizes: no collective
            self.index = FSDPDistributedIndex.from_parallel_state(instances, experts.instances)
        else:
            self.index = FSDPDistributedIndex.from_pg_collection(pg_collection, instances, experts.instances)
        check_configs(config, ddp_config, self.index.dp_cp_size)
        self.ddp_config = ddp_config
        self._checkpoint_keys: Optional[CheckpointKeys] = None
        mp = mixed_precision(config, ddp_config)
        # Megatron-Core marks the input embedding and output layer (LanguageModule); --decoupled-lr
        # gives them their own learning rate. Read before wrapping, under the engine's names.
        self.embedding_or_output_names = frozenset(
            n for n, p in module.named_parameters() if getattr(p, "is_embedding_or_output_parameter", False))
        units = tuple(unit_classes) + tuple(_tied_embedding_units(module))
        # Per-token loss normalisation sums gradients and divides by the token count later.
        average = not getattr(config, "calculate_per_token_loss", False)
        # Not a registered submodule: ``self.module`` stays the model, as Megatron expects.
        object.__setattr__(self, "_fsdp", mfsdp.fully_shard(
            module,
            strategy=ddp_config.data_parallel_sharding_strategy,
            unit_modules=units,
            mesh=self.index.mesh,
            outer_strategy=ddp_config.outer_dp_sharding_strategy if instances > 1 else None,
            average_grads=average,
            experts=self._expert_sharding(module, experts, average),
            # --fp8-param-gather: the FP8 layers' weights gathered as FP8 bytes + scales (fp8_gather.py)
            mixed_precision=dataclasses.replace(mp, param_gather=fp8_param_gather(config, ddp_config, module)),
            overlap=mfsdp.Overlap(
                **overlap_arguments(ddp_config, module, unit_classes),
                # Persistent gather buffers (Megatron-Core's field; gather_buffers.py in the engine).
                double_buffer=bool(getattr(ddp_config, "fsdp_double_buffer", False)
                                   or getattr(ddp_config, "megatron_fsdp_max_pool_double_buffer", False)),
                # Megatron-Core's DDP reduces in finish_grad_sync unless --overlap-grad-reduce, and its trainers
                # then call no no_sync: every micro-batch's backward would otherwise reduce again.
                reduce_in_backward=bool(ddp_config.overlap_grad_reduce)),
            **meta_init_arguments(module),
        ))

    def _expert_sharding(self, module: torch.nn.Module, levels: ExpertLevels,
                         average: bool) -> Optional[mfsdp.ExpertSharding]:
        """Parameters of every MoE layer's routed experts (Megatron-Core's ``MoELayer.experts``,
        also marked ``allreduce=False`` under expert parallelism): summed over the expert
        data-parallel group, then scaled by 1 / dense data-parallel size, Megatron-Core's rule."""
        expert_ids = {id(p) for m in module.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
        expert_ids |= {id(p) for p in module.parameters() if not getattr(p, "allreduce", True)}
        if not expert_ids:
            return None
        return mfsdp.ExpertSharding(
            is_expert=lambda _name, param: id(param) in expert_ids,
            mesh=self.index.expert_mesh,
            strategy=levels.inner,
            outer_strategy=levels.outer if levels.instances > 1 else None,
            average_grads=False,
            grad_scale=1.0 if not average else 1.0 / self.index.dp_cp_size,
        )

    @property
    def fsdp(self) -> mfsdp.FullyShardedModule:
        """The engine's wrapped model (units, ledger, memory report)."""
        return self._fsdp

    def forward(self, *inputs, **kwargs):
        return self._fsdp(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        with self._fsdp.no_sync():
            yield

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Megatron's hook before a chunk's forward (``--overlap-param-gather``): the engine gathers each unit in
        its own pre-forward hook, prefetching the next; ``force_sync`` waits for weights still being gathered
        after the optimizer step (non-ZeRO-3 levels), so they are current when this returns."""
        if force_sync:
            self._fsdp.wait_weights()

    def stop_communication(self) -> None:
        """Wait for every weight gather in flight (Megatron-LM calls it before reading parameters directly)."""
        self._fsdp.wait_weights()

    def start_grad_sync(self, *unused) -> None:
        self._fsdp.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        refuse_megatron_core_finalize(self.config)  # every rank alike, before the reductions
        self._fsdp.finish_grad_sync()
        if self.ddp_config.check_for_nan_in_grad:
            for unit in self._fsdp.units:
                grad = unit.storage.main_grad
                if grad.numel() and not is_fake(grad) and not torch.isfinite(grad).all():  # simulated: no values
                    raise RuntimeError(f"NaN or Inf in the gradients of FSDP unit {unit.name} on rank "
                                       f"{torch.distributed.get_rank()} (check_for_nan_in_grad)")

    def scale_gradients(self, scaling_factor: float) -> None:
        self._fsdp.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero the gradient accumulators in place, as Megatron's grad buffers are zeroed (kept).

        Accumulators already released by ``optimizer.zero_grad()`` (set_to_none, its default)
        stay released: they read as zeros and are allocated at the next backward's first
        reduction. Megatron-LM's loop calls both, so between steps no gradient memory is kept.
        """
        self._fsdp.zero_grad_buffers(set_to_none=False)

    def broadcast_params(self) -> None:
        self._fsdp.broadcast_params()

    def checkpoint_keys(self) -> CheckpointKeys:
        """This chunk's renaming between the engine's names and global checkpoint keys (see checkpoint_keys.py)."""
        if self._checkpoint_keys is None:
            self.use_checkpoint_layout()
        return self._checkpoint_keys

    def use_checkpoint_layout(self, vocab_rows: Optional[int] = None) -> None:
        """Keys and TP-global coordinates of the state dicts from now on (not a collective).

        The default is this model's own layout (what a save writes). A load of a
        checkpoint with another padded vocabulary size sets ``vocab_rows``; call it
        again without arguments afterwards.
        """
        self._fsdp.checkpoint_placements = {}
        shapes = expected_model_keys(self._fsdp)  # TP-local shapes (no placements yet)
        ranks = ParallelRanks.from_parallel_state(tp=(self.index.tp_rank, self.index.tp_size))
        self._checkpoint_keys = chunk_keys(self.module, list(shapes), ranks)
        self._fsdp.checkpoint_placements = tp_placements(self.module, shapes, ranks, vocab_rows)

    def split_rules(self):
        """How a layout-version-1 checkpoint split this chunk's parameters (``checkpoint_keys.split_rules``)."""
        keys = self.checkpoint_keys()
        return split_rules(self.module, self._fsdp.checkpoint_placements, keys)

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        """This rank's pieces for ``torch.distributed.checkpoint``, keyed by global name (no collective).

        Values are DTensors of each parameter's TP-global shape (copies of the fp32
        main weights; this rank's TP shard is a box of it) and persistent buffers.
        Keys use global layer and expert numbers, so the checkpoint loads under
        another DP size, level, mesh, TP, PP or EP.
        """
        out = destination if destination is not None else {}
        out.update(self.checkpoint_keys().globalize(self._fsdp.state_dict(), prefix))
        return out

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a ``state_dict()`` after ``dcp.load`` filled it: validated first, then compute weights
        are rebuilt from the loaded main weights (a collective)."""
        return self._fsdp.load_state_dict(self.checkpoint_keys().localize(state_dict), strict=strict)

    def full_state_dict(self):
        """Full tensors by global checkpoint key, in this rank's TP-local shapes (a collective on sharded levels)."""
        return self.checkpoint_keys().globalize(self._fsdp.full_state_dict())

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False):
        """Inside the block the wrapped module's parameters hold this rank's full weights (the fp32 main weights,
        TP-local shapes), as an unwrapped module's would, at every level: for reading them whole (AutoBridge's
        export) or, with ``write_back``, writing them (an import: on exit every rank's shards take the values
        written). A collective on sharded levels; not inside a forward or backward."""
        full = self._fsdp.full_state_dict()
        params = {name: p for name, p in self.module.named_parameters() if name in full}
        kept = {name: p.data for name, p in params.items()}
        try:
            for name, p in params.items():
                p.data = full[name]
            yield self.module
        finally:
            for name, p in params.items():
                p.data = kept[name]
        if write_back:
            self._fsdp.load_full_state_dict(full)

    def load_full_state_dict(self, state_dict, strict: bool = True):
        """Load full tensors keyed as ``full_state_dict()``; every rank takes its own piece."""
        return self._fsdp.load_full_state_dict(self.checkpoint_keys().localize(state_dict), strict=strict)
