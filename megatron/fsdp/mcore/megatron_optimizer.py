"""The engine's ``FullyShardedOptimizer`` as a ``MegatronOptimizer``, and its factory.

``get_fsdp_optimizer`` plays the role of ``megatron.core.optimizer.get_megatron_optimizer``
for chunks wrapped by ``FullyShardedDataParallel``: Adam (decoupled weight decay,
torch's AdamW as Megatron uses without Transformer Engine or Apex) or SGD with
momentum, Megatron's no-decay rule, clipping by the global norm. The global
norm counts tensor-parallel duplicates (norms) on one TP rank only, skips the
pipeline-shared copy of tied embeddings, and sums dense gradients over the
model-parallel group and expert gradients over the expert tensor x model x
pipeline group, each exactly once, like Megatron's chained dense/expert optimizers.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig

import megatron.fsdp as mfsdp
from megatron.fsdp.commands import CONVERT

from .checkpoint_keys import optimizer_keys, rename_optimizer_key
from .data_parallel import reject_fp16
from .muon import MegatronMuon, grouped_gemm_split, megatron_matrix_params, muon_kwargs, tensor_parallel_shards


class FullyShardedMegatronOptimizer(MegatronOptimizer):
    """``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)`` like Megatron's optimizers."""

    def __init__(self, engine: mfsdp.FullyShardedOptimizer, config: OptimizerConfig,
                 model_chunks: Optional[List[torch.nn.Module]] = None):
        super().__init__(engine.optimizer, config)
        self.engine = engine
        self.is_stub_optimizer = False
        self.model_chunks = list(model_chunks or [])

    def _param_keys(self) -> Dict[str, str]:
        """Engine parameter names (``chunk{k}.`` qualified over several chunks) -> global checkpoint keys.

        Without the chunks (``model_chunks`` not given) keys stay the engine's own.
        """
        if not self.model_chunks:
            return {}
        return dict(optimizer_keys(chunk.checkpoint_keys() for chunk in self.model_chunks).to_global)

    @property
    def param_groups(self) -> List[dict]:
        """The elementwise optimizer's groups, then the matrix optimizer's (Muon): the LR schedule sets both."""
        return self.engine.param_groups

    def prepare_grads(self) -> bool:
        """Finish gradient reduction; returns ``found_inf`` (always False: no loss scaling)."""
        self.engine.finish_grad_sync()
        return False

    def get_grad_norm(self) -> float:
        return self.engine.grad_norm()

    def clip_grad_norm(self, clip_grad: float) -> float:
        norm = self.engine.grad_norm()
        if clip_grad > 0.0:
            self.engine.clip_grad = clip_grad
            self.engine.clip_grads(norm)
        return norm

    def count_zeros(self) -> float:
        total = 0.0
        for section, grads in self.engine.norm_grads.items():
            zeros = torch.zeros(1)
            for g in grads:
                zeros += (g == 0).sum().float().cpu()
            total += float(self.engine.reduce_over_section(zeros, section).item())
        return total

    def step_with_ready_grads(self) -> bool:
        self.engine.step_with_ready_grads()
        return True

    @torch.no_grad()
    def step(self):
        self.prepare_grads()
        grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        ok = self.step_with_ready_grads()
        return ok, grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``set_to_none`` (Megatron's default) releases the gradient accumulators until the next
        backward; the chunks' ``zero_grad_buffer()`` zeroes them in place (Megatron's buffers)."""
        self.engine.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor([1.0])

    def reload_model_params(self, state_dict=None) -> None:
        """Nothing to copy: the wrapper's ``load_state_dict`` writes main and compute weights together."""

    def state_dict(self, main_weights: bool = True):
        """DCP-ready: fp32 main weights and every optimizer state tensor per parameter (DTensor pieces,
        global keys as the chunks' ``state_dict``), step and hyperparameters per param group.
        ``main_weights=False``: without the main weights (a save that holds them as the model's)."""
        params = self._param_keys()
        return {rename_optimizer_key(k, params): v for k, v in self.engine.state_dict(main_weights).items()
                if not _derived_group_key(k)}

    def load_state_dict(self, state_dict) -> None:
        """Load a ``state_dict()`` after ``dcp.load`` filled it, at any DP size, level or mesh (a collective)."""
        params = {g: q for q, g in self._param_keys().items()}
        state = {rename_optimizer_key(k, params): v for k, v in state_dict.items()}
        if not any(k.startswith("main.") for k in state):  # sharded_state_dict's form: the model's load set them
            state.update({k: v for k, v in self.engine.state_dict(main_weights=True).items() if k.startswith("main.")})
        stored = {k.split(".")[1] for k in state if k.startswith("param_groups.")}  # the elementwise groups
        state.update({f"param_groups.{g}.{key}": group[key] for g, group in enumerate(self.engine.param_groups)
                      for key in DERIVED_GROUP_KEYS if key in group and str(g) in stored})
        self.engine.load_state_dict(state)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None, **kwargs):
        """Megatron-LM's and Bridge's ``--ckpt-format fsdp_dtensor`` save and load: ``state_dict()`` without the
        main weights, which the model's state dict holds (``model.<key>``); ``load_state_dict`` then takes them
        from the model, which those trainers load first. Megatron's ``torch_dist`` (ShardedTensor) form is refused."""
        if (metadata or {}).get("distrib_optim_sharding_type") != "fsdp_dtensor":
            raise ValueError("megatron.fsdp checkpoints through torch DCP in whole-parameter coordinates: save with "
                             f"--ckpt-format fsdp_dtensor ({CONVERT} converts to and from torch_dist)")
        return self.state_dict(main_weights=False)


# Param-group keys this adapter derives from the config when it builds the optimizer: not state, so not in
# checkpoints (``default_config``: the groups on the command line's schedule, Megatron-LM 0.19's lr column).
DERIVED_GROUP_KEYS = ("default_config",)


def _derived_group_key(key: str) -> bool:
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "param_groups" and parts[2] in DERIVED_GROUP_KEYS


def _counts_in_norm(tp_rank: int):
    """Megatron's rule: skip pipeline-shared copies; count TP duplicates on TP rank 0 only."""
    def rule(name: str, param: torch.nn.Parameter) -> bool:
        if getattr(param, "shared", False):
            return False
        return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0
    return rule


def precision_of(config: OptimizerConfig) -> mfsdp.OptimizerPrecision:
    """Megatron's precision-aware optimizer settings (``use_precision_aware_optimizer``,
    ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``main_grads_dtype``) as the engine's value; fp32 when off."""
    if not getattr(config, "use_precision_aware_optimizer", False):
        return mfsdp.OptimizerPrecision()
    return mfsdp.OptimizerPrecision(config.exp_avg_dtype, config.exp_avg_sq_dtype, config.main_grads_dtype)


def get_fsdp_optimizer(config: OptimizerConfig, model_chunks: List[torch.nn.Module],
                       no_weight_decay_cond=None,
                       precision: Optional[mfsdp.OptimizerPrecision] = None) -> FullyShardedMegatronOptimizer:
    """One optimizer over all model chunks of this rank (each a ``FullyShardedDataParallel``).

    ``precision``: moment and main-gradient dtypes (default: from ``config``, see ``precision_of``;
    Megatron-Core's ``OptimizerConfig`` refuses ``use_precision_aware_optimizer`` without
    Transformer Engine, so the training job passes it here instead).
    """
    precision = precision if precision is not None else precision_of(config)
    reject_fp16(config)
    engines = [chunk.fsdp for chunk in model_chunks]
    if not precision.is_default(engines[0].mixed_precision.main_dtype) and config.optimizer != "adam":
        raise ValueError(f"the precision-aware optimizer (moments or main grads in another dtype than the main "
                         f"weights, e.g. bf16 main weights with fp32 moments) needs optimizer 'adam', not "
                         f"{config.optimizer!r}")
    index = model_chunks[0].index
    kwargs = dict(lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "muon":  # Megatron-LM: Muon for the matrices, Adam's config for the rest
        kwargs.update(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                      **muon_engine_kwargs(config, engines, index))
        cls = torch.optim.AdamW
    elif config.optimizer == "adam":
        cls = torch.optim.AdamW if getattr(config, "decoupled_weight_decay", True) else torch.optim.Adam
        kwargs.update(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    elif config.optimizer == "sgd":
        cls = torch.optim.SGD
        kwargs.update(momentum=config.sgd_momentum)
    else:
        raise ValueError(f"optimizer {config.optimizer!r} is not supported by megatron.fsdp; "
                         "use 'adam', 'sgd' or 'muon'")
    engine = mfsdp.FullyShardedOptimizer(
        engines, cls, clip_grad=config.clip_grad, **decoupled_lr_groups(config, model_chunks),
        no_weight_decay=no_weight_decay_cond or mfsdp.megatron_no_weight_decay,
        # With experts in the model every stage joins the expert norm, also a stage without MoE layers.
        grad_norm=mfsdp.GradNorm(_counts_in_norm(index.tp_rank), groups=[index.mp], expert_groups=[index.expt_mp]
                                 if getattr(model_chunks[0].config, "num_moe_experts", None) else None),
        precision=precision, **kwargs)
    # Keys Megatron's OptimizerParamScheduler reads from every param group (the matrix group decays);
    # Megatron-Core's decoupled groups carry --decoupled-lr / --decoupled-min-lr as their max/min lr.
    # ``default_config``: the groups on the command line's schedule (Megatron-LM >= 0.19 logs their lr).
    for group, (label, no_decay) in zip(engine.param_groups, engine.group_labels + [("", False)]):
        decoupled = label == DECOUPLED
        group.update(max_lr=config.decoupled_lr if decoupled else config.lr,
                     min_lr=(config.decoupled_min_lr if config.decoupled_min_lr is not None else config.min_lr)
                     if decoupled else config.min_lr, lr_mult=1.0,
                     wd_mult=0.0 if no_decay else 1.0, is_expert_parallel=False, is_decoupled_lr=False,
                     default_config=not decoupled)
    return FullyShardedMegatronOptimizer(engine, config, model_chunks)


DECOUPLED = "decoupled_lr"


def decoupled_lr_groups(config: OptimizerConfig, model_chunks) -> dict:
    """``FullyShardedOptimizer`` arguments for Megatron-Core's ``decoupled_lr``: the parameters Megatron-Core
    marks ``is_embedding_or_output_parameter`` (input embedding, output layer) in groups of their own,
    as ``get_standard_config_overrides`` does; nothing without it."""
    if getattr(config, "decoupled_lr", None) is None:
        return {}
    names = frozenset().union(*(chunk.embedding_or_output_names for chunk in model_chunks))

    def group(name: str, _param) -> str:  # the chunks share names; only chunks holding the layer have it
        return DECOUPLED if name in names else ""
    return dict(labelled_groups=mfsdp.LabelledGroups(group, {DECOUPLED: {"lr": config.decoupled_lr}}))


def muon_engine_kwargs(config: OptimizerConfig, engines, index) -> dict:
    """The engine's matrix-optimizer arguments for ``--optimizer muon`` (see muon.py for the mapping)."""
    if getattr(config, "fp16", False):
        raise ValueError("muon with fp16 is not supported (as in Megatron-LM); use --bf16")
    from megatron.core import parallel_state

    expert_tp = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    return dict(matrix=mfsdp.PerMatrixOptimizer(
        MegatronMuon, muon_kwargs(config), params=megatron_matrix_params,
        split=grouped_gemm_split([e.module for e in engines]),
        shards=tensor_parallel_shards(config.muon_tp_mode, engines[0].ledger, index.tp, expert_tp)))
