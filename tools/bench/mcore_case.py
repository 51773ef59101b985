"""The Megatron-Core workload: ``GPTModel`` trained as Megatron-LM trains it, under each wrapper.

The model, the parallel state and the step are Megatron's own: ``gpt_chunks`` (the training
job's builder) with the CPU layer spec, ``get_forward_backward_func`` with one micro-batch,
then ``optimizer.step()``. This project's adapter and Megatron-Core's DDP and
DistributedOptimizer are wrapped by ``megatron.fsdp_training.model.wrap_and_optimize``, the
code ``pretrain_gpt.py`` runs, so the benchmark measures what users get; for bf16
Megatron's wrappers get ``Float16Module`` first, as Megatron-LM's ``get_model`` does
(the adapter casts by itself). Megatron-FSDP v1 (``megatron.core.distributed.fsdp``)
is wrapped as Megatron-LM does under ``--use-megatron-fsdp``. The floor is the same
``GPTModel`` unwrapped (``Float16Module`` for bf16) with the torch workload's
``FloorOptimizer``: Megatron's schedule with no gradient hooks and no collectives.

Every system runs under Megatron-Core's CPU mode (``megatron.fsdp.mcore_cpu.cuda_standins``): its
CUDA-to-CPU redirection costs every system the same per torch call. ``run`` is a
worker-pool case (``megatron/fsdp/testing/pool.py``) on every rank of the pool.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tools.bench import measure as M
from tools.bench.spec import (BETAS, CLIP_GRAD, EPS, FLOOR, LEVEL_OF, LR, SIZES, WEIGHT_DECAY,
                             gather_buffer_elements, option_of)


def _config(size_name: str, bf16: bool):
    from megatron.fsdp_training.testing.gpt import Topology, tiny_gpt_config

    s = SIZES[size_name]
    return tiny_gpt_config(Topology(), num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
                           ffn_hidden_size=4 * s.hidden, bf16=bf16,
                           pipeline_dtype=torch.bfloat16 if bf16 else torch.float32)


def _args(system: str, bf16: bool):
    """The training job's arguments (its parser's defaults) with this benchmark's settings."""
    from megatron.fsdp_training.arguments import build_parser
    from megatron.fsdp_training.arguments.megatron_fsdp_flags import apply_megatron_fsdp_defaults

    ours = system.startswith("ours:")
    option = option_of(system)  # the job's flag of each option row, as validate_args maps it
    args = build_parser().parse_args([])
    vars(args).update(
        use_megatron_fsdp=ours, data_parallel_sharding_strategy=LEVEL_OF[system] if ours else "no_shard",
        grad_reduce_in_fp32=option != "bf16_reduce", grad_reduce_in_bf16=option == "bf16_reduce",
        fsdp_double_buffer=option == "double_buffer", use_distributed_optimizer=system == "mcore_distopt", optimizer="adam", lr=LR,
        min_lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
        clip_grad=CLIP_GRAD, bf16=bf16)
    apply_megatron_fsdp_defaults(args)  # what --use-megatron-fsdp implies, as validate_args applies it
    return args


def _megatron_fsdp_v1(config, chunks, args):
    """Megatron-FSDP v1 from megatron-core 0.16.1, set up as Megatron-LM's ``--use-megatron-fsdp`` does."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides
    from megatron.fsdp_training.initialize import gloo_twin_groups
    from megatron.fsdp_training.model import optimizer_config

    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params",
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True, check_for_nan_in_grad=True,
        gradient_reduce_div_fusion=False)  # gloo has no PREMUL_SUM: scale, then sum
    model = [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                      device=torch.device("cpu")) for chunk in chunks]
    args.use_distributed_optimizer = True
    opt_config = optimizer_config(args)
    # as wrap_and_optimize does: on CPU every group is gloo, so Megatron-Core creates no gloo twins to ask for
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=get_standard_config_overrides(opt_config),
                                       use_gloo_process_groups=gloo_twin_groups(args.disable_gloo_process_groups))

    def wire():
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = model[0].no_sync
        config.grad_sync_func = model[0].start_grad_sync
        config.param_sync_func = None
        config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, wire


class _FloorStep:
    """The floor's optimizer in the interface the step below calls (``step() -> (ok, norm, zeros)``)."""

    def __init__(self, chunks, bf16: bool):
        from tools.bench.torch_case import FloorOptimizer

        self.floor = FloorOptimizer([(n, p) for chunk in chunks for n, p in chunk.named_parameters()], bf16)

    def step(self):
        return True, float(self.floor.step()), 0

    def zero_grad(self):
        """Done by ``step`` (as the torch workload's floor does)."""


def _floor(config, chunks, bf16: bool):
    """The unwrapped GPTModel on every rank: no DDP, no gradient hooks, no finalize (nothing exchanged)."""
    optimizer = _FloorStep(chunks, bf16)  # before Float16Module casts the parameters in place
    return (_float16(config, chunks) if bf16 else chunks), optimizer, lambda: None


def _wrap(system: str, config, chunks, bf16: bool):
    """(model chunks, optimizer, wire) as ``wrap_and_optimize`` returns them, for every mcore system."""
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.initialize import gloo_twin_groups

    if system == FLOOR:
        return _floor(config, chunks, bf16)
    args = _args(system, bf16)
    if not system.startswith("ours:"):
        if system not in ("mcore_ddp", "mcore_distopt", "mfsdp_v1"):
            raise ValueError(f"unknown mcore-workload system {system!r}")
    if system == "mfsdp_v1":  # wrap_and_optimize applies Float16Module itself for Megatron's DDP
        return _megatron_fsdp_v1(config, _float16(config, chunks) if bf16 else chunks, args)
    return model_lib.wrap_and_optimize(
        config, chunks, model_lib.ddp_config(args, model_lib.parameter_count(chunks)), model_lib.optimizer_config(args),
        model_lib.optimizer_precision(args), gloo_twin_groups(args.disable_gloo_process_groups))


def _float16(config, chunks):
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(config, chunk) for chunk in chunks]


def _batch(size_name: str) -> dict:
    s = SIZES[size_name]
    gen = torch.Generator().manual_seed(4321 + dist.get_rank())
    tokens = torch.randint(0, s.vocab, (s.rows, s.seq + 1), generator=gen)
    causal = torch.triu(torch.ones(s.seq, s.seq, dtype=torch.bool), diagonal=1)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(s.rows, s.seq), "position_ids": torch.arange(s.seq).expand(s.rows, s.seq),
            "attention_mask": causal.expand(s.rows, 1, s.seq, s.seq)}


def _unit_params(module: torch.nn.Module) -> list:
    """Parameters of the root (everything outside the layers: embeddings, final norm, output), then of each layer."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    in_layers = {id(p) for m in layers for p in m.parameters()}
    root = sum(p.numel() for p in module.parameters() if id(p) not in in_layers)
    return [root] + [sum(p.numel() for p in m.parameters()) for m in layers]


def _engine_figures(model, optimizer):
    """This project's ledgers and memory report (the adapter exposes the engine as ``.fsdp``)."""
    engines = [getattr(chunk, "fsdp", None) for chunk in model]
    if any(e is None for e in engines):
        return [], None
    engine_opt = getattr(optimizer, "engine", None)
    return [e.ledger for e in engines], lambda: sum(e.memory_report(engine_opt).total for e in engines)


def run(ctx, system: str, size_name: str, bf16: bool, warmup: int, steps: int, worker: M.WorkerSetting) -> dict:
    """Build ``system`` on Megatron's GPTModel of ``size_name``; train; return this rank's figures.

    ``worker.job_allocator``: glibc set up as ``initialize`` sets it for pretrain_gpt.py
    (``allocator.apply_job_setting``); ``wrap_and_optimize`` then adds the job's heap trim (``run.py``
    refuses the threshold without the trim for this workload).
    """
    worker.apply()
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.fsdp.mcore_cpu.cuda_standins import cpu_layer_spec
    from megatron.fsdp_training.model import gpt_chunks
    from megatron.fsdp_training.testing.gpt import Topology, forward_step, parallel, set_random_seed

    s = SIZES[size_name]
    with parallel(ctx, Topology()):
        M.COUNTER.install()  # after Megatron-Core's imports: it binds collectives at import time
        batch = _batch(size_name)
        base_tensors, base_rss = M.baselines()
        config = _config(size_name, bf16)
        set_random_seed()
        chunks = gpt_chunks(config, lambda vp_stage: cpu_layer_spec(config, vp_stage=vp_stage), s.vocab, s.seq)
        params = sum(p.numel() for p in chunks[0].parameters())
        units = _unit_params(chunks[0])
        model, optimizer, wire = _wrap(system, config, chunks, bf16)
        wire()
        forward_backward = get_forward_backward_func()
        for chunk in model:
            chunk.train()

        # the floor's chunks have no gradient buffer (its step clears the grads)
        grad_buffers = [] if system == FLOOR else [chunk.zero_grad_buffer for chunk in model]

        def step():
            forward_backward(forward_step_func=forward_step, data_iterator=iter([batch]), model=model[0],
                             num_microbatches=1, seq_length=s.seq, micro_batch_size=s.rows,
                             decoder_seq_length=s.seq, forward_only=False)
            ok, _norm, _zeros = optimizer.step()
            if not ok:
                raise RuntimeError("optimizer step skipped (non-finite gradients)")
            # Gradients cleared after the step, as the torch workload does (the same training; Megatron-LM's
            # loop clears at the next iteration's start): between steps each system holds what it keeps
            # by design (Megatron-Core's grad buffers stay allocated, zeroed; this project's are released),
            # which is what the persistent-memory theory counts.
            for zero_grad_buffer in grad_buffers:
                zero_grad_buffer()
            optimizer.zero_grad()

        ledgers, own = _engine_figures(model, optimizer)
        result = M.measure(M.Built(step, ledgers=ledgers, own_report=own), warmup, steps, base_tensors, base_rss)
        del step, grad_buffers, model, optimizer, chunks, wire
    M.trim_heap()
    result.update(params=params, root_params=units[0], last_unit_params=units[-1],
                  tokens_per_step=s.rows * s.seq * dist.get_world_size(),
                  gather_buffer_params=gather_buffer_elements(units))
    return result
