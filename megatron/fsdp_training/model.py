"""Build the GPT model chunks, the data-parallel wrappers, the optimizer and the LR schedule.

``--use-megatron-fsdp`` selects this project's adapter; without it, Megatron-Core's
own ``DistributedDataParallel`` (and ``DistributedOptimizer`` with
``--use-distributed-optimizer``): the baseline users compare against. The choice
is made here, once (``ddp_config``); nothing else in the job branches on it.

The mappers read the flags once into typed values: Megatron-Core's own ``TransformerConfig``
(``transformer_config``), ``OptimizerConfig`` (``optimizer_config``) and data-parallel config
(``ddp_config``), the engine's ``OptimizerPrecision`` (``optimizer_precision``), and two frozen views
(``ModelBuildConfig``, ``ScheduleConfig``); the builders take only those.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from .allocator import job_post_backward_hook


def transformer_config(args, cpu: bool):
    """Mapper of the flags to Megatron-Core's (MLA)TransformerConfig (Megatron-LM's core_transformer_config_from_args)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from .arguments.model_flags import gradient_accumulation_fusion, transformer_config_fields as kernel_config_fields
    from .arguments.precision_flags import fp8_config_fields
    from .model_shape import transformer_config_fields
    from .moe_dispatch import dispatcher_settings

    interleaved = args.virtual_pipeline_model_parallel_size is not None
    moe = {} if args.num_experts is None else dict(
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        **dispatcher_settings(args.moe_token_dispatcher_type, getattr(args, "moe_flex_dispatcher_backend", "deepep"),
                              getattr(args, "moe_permute_fusion", False)),
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_grouped_gemm=args.moe_grouped_gemm, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type)
    # Megatron-LM's core_transformer_config_from_args: multi-latent attention has a config class of its own.
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    return config_class(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel,
        bf16=args.bf16, params_dtype=torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        # CPU runs always initialise on the CPU; GPU runs build on the device unless asked (Megatron-LM's flag).
        use_cpu_initialization=cpu or args.use_cpu_initialization,
        init_model_with_meta_device=args.init_model_with_meta_device,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method if args.recompute_granularity == "full" else None,
        recompute_num_layers=args.recompute_num_layers if args.recompute_granularity == "full" else None,
        # Fused CUDA kernels do not exist on CPU. Gradient-accumulation fusion (Megatron-LM's default, off
        # with --no-gradient-accumulation-fusion) only where APEX's kernel exists; the other fusion flags too:
        # arguments/model_flags.py.
        gradient_accumulation_fusion=gradient_accumulation_fusion(args),
        bias_dropout_fusion=not cpu, persist_layer_norm=not cpu,
        deallocate_pipeline_outputs=True, **kernel_config_fields(args, cpu),
        overlap_p2p_comm=interleaved, batch_p2p_comm=not interleaved,
        add_bias_linear=args.add_bias_linear, **moe, **transformer_config_fields(args),
        **fp8_config_fields(args),  # Transformer Engine's FP8 only; the CPU FP8 layers take their recipe in the spec
    )


@dataclasses.dataclass(frozen=True)
class ModelBuildConfig:
    """What builds the chunks besides the TransformerConfig: the ``GPTModel`` arguments of the flags and the
    layer spec's choices (CPU layers or Megatron-Core's, Transformer Engine's or local, the CPU FP8 recipe)."""

    max_position_embeddings: int
    tie_embeddings: bool  # not --untie-embeddings-and-output-weights
    position_embedding_type: str
    rotary_percent: float
    rotary_base: int
    cpu: bool  # the CPU layers (megatron.fsdp.mcore_cpu)
    transformer_engine: bool  # --transformer-impl transformer_engine
    cpu_fp8: Optional[object] = None  # the CPU FP8 layers' Fp8Recipe (arguments/precision_flags.cpu_recipe)

    @classmethod
    def from_args(cls, args, cpu: bool) -> "ModelBuildConfig":
        """Mapper: the GPTModel and layer-spec flags."""
        from .arguments.precision_flags import cpu_recipe

        return cls(max_position_embeddings=args.max_position_embeddings,
                   tie_embeddings=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                   rotary_base=args.rotary_base, cpu=cpu,
                   transformer_engine=args.transformer_impl == "transformer_engine", cpu_fp8=cpu_recipe(args))

    def gpt_model_kwargs(self) -> dict:
        """The further ``GPTModel`` arguments these flags set (``gpt_chunks``'s keywords)."""
        return dict(position_embedding_type=self.position_embedding_type, rotary_percent=self.rotary_percent,
                    rotary_base=self.rotary_base)


def _layer_spec(config, build: ModelBuildConfig, vp_stage):
    if build.cpu:  # FP8 without Transformer Engine: the CPU layers with the recipe's FP8 linears (arguments/precision_flags.py)
        from megatron.fsdp.mcore_cpu.cuda_standins import cpu_layer_spec

        return cpu_layer_spec(config, vp_stage=vp_stage, fp8=build.cpu_fp8)
    # Megatron-LM's block spec: per-layer dense/MoE specs (--moe-layer-freq), qk-layernorm, MLA and the
    # normalization from the config, this stage's layers only.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=build.transformer_engine,
                                      normalization=config.normalization, vp_stage=vp_stage)


def mtp_block_spec(config, block_spec, cpu: bool, use_transformer_engine: bool = False, vp_stage=None, fp8=None):
    """The multi-token prediction block of this stage (None without --mtp-num-layers, or off the MTP stage):
    Megatron-LM's ``get_gpt_mtp_block_spec`` around the decoder's last layer spec (``fp8``: the CPU FP8 recipe)."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    if cpu:
        from megatron.fsdp.mcore_cpu.cuda_standins import cpu_mtp_block_spec

        return cpu_mtp_block_spec(config, block_spec, vp_stage=vp_stage, fp8=fp8)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=use_transformer_engine,
                                  vp_stage=vp_stage)


def gpt_chunks(config, layer_spec_for, vocab_size: int, max_sequence_length: int,
               tie_embeddings: bool = True, mtp_spec_for=None, **gpt_model_kwargs) -> List[torch.nn.Module]:
    """One ``GPTModel`` per virtual pipeline stage of this rank, as Megatron-LM's ``get_model`` builds them.

    ``layer_spec_for(vp_stage)`` gives the layer spec of each chunk, ``mtp_spec_for(config, layer spec,
    vp_stage)`` its multi-token prediction block (``mtp_block_spec``); ``gpt_model_kwargs`` are further
    ``GPTModel`` arguments (position embedding type, rotary base and percent).
    """
    gpt_model_kwargs.setdefault("position_embedding_type", "learned_absolute")
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.enums import ModelType

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in ([None] if vpp is None else range(vpp)):
        if vp_stage is None:
            pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        else:
            pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        spec = layer_spec_for(vp_stage)
        mtp = mtp_spec_for(config, spec, vp_stage) if mtp_spec_for is not None else None
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                         max_sequence_length=max_sequence_length, pre_process=pre, post_process=post,
                         parallel_output=True, share_embeddings_and_output_weights=tie_embeddings,
                         vp_stage=vp_stage, mtp_block_spec=mtp, **gpt_model_kwargs)
        model.model_type = ModelType.encoder_or_decoder
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunks.append(model)
    return chunks


def build_model_chunks(config, build: ModelBuildConfig, vocab_size: int) -> List[torch.nn.Module]:
    """Megatron-LM's ``get_model`` without the wrap: on the device, or on meta with
    ``--init-model-with-meta-device`` (the adapter then materialises and initialises each unit)."""
    cpu = build.cpu

    def chunks():
        return gpt_chunks(config, lambda vp_stage: _layer_spec(config, build, vp_stage), vocab_size,
                          build.max_position_embeddings, build.tie_embeddings,
                          mtp_spec_for=lambda c, spec, vp: mtp_block_spec(c, spec, cpu, build.transformer_engine, vp,
                                                                          build.cpu_fp8),
                          **build.gpt_model_kwargs())
    if config.init_model_with_meta_device:
        from megatron.fsdp.mcore.meta_build import build_on_meta_device

        return build_on_meta_device(chunks)
    built = chunks()
    if not cpu:
        for model in built:
            model.cuda(torch.cuda.current_device())
    return built


def optimizer_config(args):
    """Mapper of the optimizer flags to Megatron-Core's OptimizerConfig (Megatron-LM's get_megatron_optimizer_config).

    Muon's fields (read by megatron.fsdp.mcore's --optimizer muon): the Nesterov field under this release's name
    (``mcore_releases.MUON_NESTEROV_FIELD``), the coefficient set where the release has its field
    (``mcore_releases.MUON_COEFFICIENT_TYPE_IS_FIELD``), else an attribute read by
    ``mcore_releases.muon_coefficient_type``."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron.fsdp.mcore_releases import MUON_COEFFICIENT_TYPE_IS_FIELD, MUON_NESTEROV_FIELD

    muon = {f"muon_{k}": getattr(args, f"muon_{k}") for k in
            ("momentum", "num_ns_steps", "scale_mode", "extra_scale_factor", "tp_mode")}
    muon[MUON_NESTEROV_FIELD] = args.muon_use_nesterov
    if MUON_COEFFICIENT_TYPE_IS_FIELD:
        muon["muon_coefficient_type"] = args.muon_coefficient_type
    config = OptimizerConfig(optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                           sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16,
                           params_dtype=torch.float32, use_distributed_optimizer=args.use_distributed_optimizer,
                           decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
                           log_num_zeros_in_grad=args.log_num_zeros_in_grad, **muon)
    if not MUON_COEFFICIENT_TYPE_IS_FIELD:  # before Megatron-Core 0.17 an attribute, read by mcore_releases.muon_coefficient_type
        config.muon_coefficient_type = args.muon_coefficient_type
    return config


def optimizer_precision(args):
    """Mapper of ``--use-precision-aware-optimizer`` and its dtypes to the engine's ``OptimizerPrecision``."""
    import megatron.fsdp as mfsdp

    if not getattr(args, "use_precision_aware_optimizer", False):
        return mfsdp.OptimizerPrecision()
    names = mfsdp.precision.optimizer_state.DTYPE_NAMES
    # bf16 main gradients when asked; otherwise the main weights' dtype (fp32, or bf16 for bf16 main weights)
    return mfsdp.OptimizerPrecision(names[args.exp_avg_dtype], names[args.exp_avg_sq_dtype],
                                    names["bf16"] if args.main_grads_dtype == "bf16" else None)


def ddp_config(args, num_parameters: int):
    """Mapper of the data-parallel flags to the wrapper's config (Megatron-LM's get_megatron_ddp_config).

    ``--use-megatron-fsdp``: the adapter's ``FullyShardedDataParallelConfig``; else Megatron-Core's
    ``DistributedDataParallelConfig`` of the baseline, where ``num_parameters`` (this rank's parameters over
    all its model chunks) is what ``--ddp-num-buckets`` divides (Megatron-LM's resolve_ddp_bucket_size;
    Megatron-Core's DDP then applies its default size and drops buckets without ``--overlap-grad-reduce``).
    """
    if args.use_megatron_fsdp:
        from megatron.fsdp.mcore import FullyShardedDataParallelConfig

        from .arguments.megatron_fsdp_flags import main_params_dtype

        return FullyShardedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
            outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
            expert_data_parallel_sharding_strategy=args.expert_data_parallel_sharding_strategy,
            expert_outer_dp_sharding_strategy=args.expert_outer_dp_sharding_strategy,
            expert_num_distributed_optimizer_instances=args.expert_num_distributed_optimizer_instances,
            grad_reduce_in_fp32=args.grad_reduce_in_fp32,
            check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
            fsdp_double_buffer=getattr(args, "fsdp_double_buffer", False),
            megatron_fsdp_main_params_dtype=main_params_dtype(args),
            # the engine gathers the FP8 layers' weights in FP8 (megatron/fsdp/mcore/fp8_gather.py)
            fp8_param_gather=args.fp8 is not None and args.fp8_param_gather)
    from megatron.core.distributed import DistributedDataParallelConfig

    from .arguments.precision_flags import transformer_engine_used

    bucket_size = args.ddp_bucket_size
    if args.ddp_num_buckets is not None:
        bucket_size = max(1, num_parameters // args.ddp_num_buckets)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.grad_reduce_in_fp32, use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, align_param_gather=args.align_param_gather,
        bucket_size=bucket_size,
        # Megatron-Core's FP8 primary weights are Transformer Engine tensors; without TE the CPU FP8 layers
        # quantize their bf16 weights (the substitution line of arguments/precision_flags.py says so)
        fp8_param_gather=args.fp8 is not None and args.fp8_param_gather and transformer_engine_used(args))


def parameter_count(chunks) -> int:
    """This rank's parameters over all its model chunks (what ``ddp_config`` takes)."""
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def param_sync_func(ddp_config, model):
    """Megatron-LM's ``config.param_sync_func``: the chunks' ``start_param_sync`` when the interleaved schedule
    starts the distributed optimizer's weight gathers itself (``--overlap-param-gather``, aligned), else None."""
    if not (ddp_config.overlap_param_gather and ddp_config.align_param_gather):
        return None
    funcs = [chunk.start_param_sync for chunk in model]
    return funcs[0] if len(funcs) == 1 else funcs


def wrap_and_optimize(config, chunks, ddp_config, opt_config, precision, use_gloo_process_groups: bool):
    """Data-parallel wrappers (the engine's for ``ddp_config.use_megatron_fsdp``, else Megatron-Core's DDP),
    optimizer and the function that sets the schedule hooks (then, for the CPU FP8 layers' delayed scaling, its
    once-per-step advance around ``finalize_model_grads``).

    ``precision``: the engine's ``OptimizerPrecision``; ``use_gloo_process_groups``: the baseline optimizer's
    gloo twins (``initialize.gloo_twin_groups``)."""
    if ddp_config.use_megatron_fsdp:
        model, optimizer, wire_data_parallel = _fully_sharded(config, chunks, ddp_config, opt_config, precision)
    else:
        model, optimizer, wire_data_parallel = _baseline(config, chunks, ddp_config, opt_config,
                                                         use_gloo_process_groups)

    def wire():
        wire_data_parallel()
        from megatron.fsdp.mcore_cpu.fp8_linears import install_step_end

        install_step_end(config, model)
    return model, optimizer, wire


def _fully_sharded(config, chunks, ddp_config, opt_config, precision):
    from megatron.fsdp.mcore import FullyShardedDataParallel, configure_schedule_hooks, get_fsdp_optimizer

    model = [FullyShardedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    optimizer = get_fsdp_optimizer(opt_config, model, precision=precision)
    trim = job_post_backward_hook()  # the job's allocator setting, second half (allocator.py)
    if trim is not None:
        for chunk in model:
            chunk.fsdp.register_post_backward_hook(trim)

    def wire():
        config.grad_scale_func = optimizer.scale_loss
        configure_schedule_hooks(config, model)
    return model, optimizer, wire


def _baseline(config, chunks, ddp_config, opt_config, use_gloo_process_groups: bool):
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

    if config.bf16:  # Megatron-LM's get_model: bf16 compute through Float16Module (fp32 params kept by the optimizer)
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, chunk) for chunk in chunks]
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=get_standard_config_overrides(opt_config),
                                       use_gloo_process_groups=use_gloo_process_groups)

    def wire():
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = config.grad_sync_func = None
        config.param_sync_func = param_sync_func(ddp_config, model)
        config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, wire


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The learning-rate and weight-decay schedule of the flags, lengths in samples (batch_rampup.py)."""

    lr_warmup_init: float
    lr: float
    min_lr: float
    lr_decay_style: str
    weight_decay: float
    lr_warmup_steps: float
    lr_decay_steps: float
    wd_incr_steps: float
    use_checkpoint_opt_param_scheduler: bool
    override_opt_param_scheduler: bool

    @classmethod
    def from_args(cls, args) -> "ScheduleConfig":
        """Mapper: the schedule flags, the lengths from ``--train-iters``/``--train-samples`` and the batch."""
        from .batch_rampup import ScheduleLengths

        return cls(lr_warmup_init=args.lr_warmup_init, lr=args.lr, min_lr=args.min_lr,
                   lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay,
                   **ScheduleLengths.from_args(args).in_samples(),
                   use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
                   override_opt_param_scheduler=args.override_opt_param_scheduler)


def scheduler(schedule: ScheduleConfig, optimizer):
    """Megatron-LM's ``get_optimizer_param_scheduler``: warm-up from ``--lr-warmup-init``; the decoupled groups
    carry their own max/min lr."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=schedule.lr_warmup_init, max_lr=schedule.lr, min_lr=schedule.min_lr,
        lr_decay_style=schedule.lr_decay_style, start_wd=schedule.weight_decay, end_wd=schedule.weight_decay,
        wd_incr_style="constant", lr_warmup_steps=schedule.lr_warmup_steps, lr_decay_steps=schedule.lr_decay_steps,
        wd_incr_steps=schedule.wd_incr_steps,
        # Megatron-LM's rule at load (checkpointing/compatibility.py): without either flag a schedule that differs
        # from the checkpoint's stops the load; Megatron-Core's default (the checkpoint's values) is not Megatron-LM's.
        use_checkpoint_opt_param_scheduler=schedule.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=schedule.override_opt_param_scheduler)


def params_norm(model, optimizer) -> float:
    """Megatron-LM's ``calc_params_l2_norm`` for ``--log-params-norm``: the fp32 main weights, each
    element once (tensor-parallel duplicates on TP rank 0, pipeline-shared copies skipped)."""
    engine = getattr(optimizer, "engine", None)
    if engine is not None:  # megatron.fsdp: its shards, counted as its gradient norm counts them
        return engine.params_norm()
    import math

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dense, expert = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    tp_rank = ps.get_tensor_model_parallel_rank()
    for chunk in model:
        if chunk.ddp_config.overlap_param_gather:  # the updated weights would arrive in the next forward
            chunk.start_param_sync(force_sync=True)
        for param in chunk.parameters():
            if getattr(param, "shared", False) or not (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
                continue
            main = getattr(param, "main_param", None)
            value = float((main if main is not None else param).detach().double().pow(2).sum())
            if getattr(param, "allreduce", True):
                dense += value
            else:
                expert += value
    dist.all_reduce(dense, group=ps.get_model_parallel_group())
    dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return math.sqrt(float(dense + expert))
