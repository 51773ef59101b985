"""Megatron-LM's everyday flags that its launch scripts pass, with its names, defaults and meanings.

A Megatron-LM script must run unchanged (docs/training.md, "Coming from Megatron-LM"). Each
flag here is one of:

* honoured: it does here what it does there (fusion switches, ``--apply-layernorm-1p``,
  ``--recompute-modules``, the data and logging flags, ``--manual-gc``, ...);
* substituted: it picks a kernel or backend this machine lacks; the job runs the one it has
  and says so in the one start-up line of ``substitutions.py`` (``compat_substitutions``);
* refused: it would change the mathematics or needs a feature not implemented; start-up
  stops with one line naming it (``validate_compat``).

The non-persistent checkpoint flags have their own module (``non_persistent.py`` of this package).
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import List
import logging

from .non_persistent import add_non_persistent_args, non_persistent_substitutions, \
    validate_non_persistent
from ..errors import ArgumentError
from .substitution_record import Substitution

ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
# Megatron-Core 0.16.1's TransformerConfig accepts these in recompute_modules.
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")


def add_compat_args(p: argparse.ArgumentParser) -> None:
    """The flags, grouped as Megatron-LM's ``arguments.py`` groups them."""
    g = p.add_argument_group("kernels and fusions (Megatron-LM's flags; substituted where this machine lacks them)")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="deprecated in Megatron-LM; models are always Megatron-Core's here (no effect)")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="do not fuse scaling, masking and softmax (the fused kernel needs CUDA)")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="do not fuse the bias add and GeLU")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="do not fuse the bias add and SwiGLU")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false",
                   help="do not fuse rotary position embedding (the fused kernel needs Transformer Engine)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fuse the vocabulary-parallel cross entropy (Megatron-Core's native kernel; CUDA)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="attention backend (Transformer Engine chooses with auto); on CPU always PyTorch SDPA")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="FlashAttention (Megatron-LM no longer reads it: --attention-backend decides)")
    g.add_argument("--apply-layernorm-1p", dest="layernorm_zero_centered_gamma", action="store_true",
                   help="norms store gamma - 1 (zero-centred, initialised to 0) and scale by 1 + gamma")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="deprecated in Megatron-LM: no effect with --position-embedding-type rope, refused otherwise "
                        "(use --position-embedding-type none)")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None,
                   help="TikTokenizer's pattern (only TikTokenizer reads it)")
    g.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, default=None,
                   help="submodules recomputed with --recompute-granularity selective, as Megatron-Core "
                        "(default: core_attn)")
    g.add_argument("--enable-experimental", action="store_true",
                   help="enable Megatron-Core's experimental features (megatron.core.config.set_experimental_flag)")
    g.add_argument("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default="none",
                   help="CUDA graph capture of the layers or the whole iteration; on CPU there is nothing to capture "
                        "(said at start-up), on CUDA anything but none is refused (not implemented)")
    g = p.add_argument_group("communication overlap (Megatron-LM's flags)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron-Core DDP: reduce gradient buckets during the backward pass. --use-megatron-fsdp "
                        "always overlaps each unit's reduction with the backward of the next")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="distributed optimizer: gather updated weights during the next forward. --use-megatron-fsdp "
                        "always prefetches the next unit's gather")
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="start the first bucket's weight gather inside the optimizer step (Megatron-LM needs "
                        "--ckpt-format torch for it, which this job does not have: refused with the reason)")
    g.add_argument("--no-align-param-gather", dest="align_param_gather", action="store_false",
                   help="with --overlap-param-gather and virtual pipeline stages: each stage starts its weight "
                        "gathers when it needs them instead of all stages together (aligned, as without the flag). "
                        "--use-megatron-fsdp always gathers per stage (each unit's pre-forward hook)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Megatron-Core DDP: parameters per gradient bucket with --overlap-grad-reduce; "
                        "--use-megatron-fsdp reduces per unit (default: Megatron-Core's, 40M or 1M x the "
                        "data-parallel size if larger)")
    g.add_argument("--ddp-num-buckets", type=int, default=None,
                   help="Megatron-Core DDP: gradient buckets with --overlap-grad-reduce, i.e. a bucket size of this "
                        "rank's parameters / N (Megatron-LM's resolve_ddp_bucket_size); --use-megatron-fsdp reduces "
                        "per unit")
    g = p.add_argument_group("memory and time (Megatron-LM's flags)")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's threshold garbage collector; collect at start, around evaluation and every "
                        "--manual-gc-interval iterations, the same step on every rank")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="iterations between manual collections with --manual-gc (0: only around evaluation)")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="torch.cuda.empty_cache() after forward-backward (1) and also after the optimizer step (2); "
                        "nothing to release on CPU")
    g.add_argument("--record-memory-history", action="store_true",
                   help="record the CUDA caching allocator's history and dump snapshots (--memory-snapshot-path); "
                        "nothing to record on CPU (said at start-up), refused on CUDA (not implemented)")
    g.add_argument("--memory-snapshot-path", default=None,
                   help="where --record-memory-history writes its snapshots (default: snapshot.pickle)")
    g.add_argument("--exit-duration-in-mins", type=int, default=None,
                   help="stop (saving first with --save) after the iteration at which this many minutes have "
                        "passed since start-up on any rank")
    g = p.add_argument_group("data (Megatron-LM's flags)")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read the .bin files instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false", help="no attention mask from the dataset: attention is causal by construction")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"weights and prefixes of an independent {split} dataset (as --data-path; "
                            "replaces --data-path and --split)")
    g = p.add_argument_group("logging (Megatron-LM's flags)")
    g.add_argument("--log-params-norm", action="store_true", help="log the L2 norm of the parameters")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="log the number of zeros in the gradients")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write the peak and current memory as scalars")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="write the validation perplexity as a scalar")
    g.add_argument("--logging-level", type=int, default=None, help="level of the root Python logger")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0,
                   help="Megatron-LM's timer granularity: the job's timers (forward-backward, all-grads-sync, "
                        "optimizer) are its level 1; 2 adds none")
    g = p.add_argument_group("checkpoint and numerics checks (Megatron-LM's flags)")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="Megatron-LM: load whichever format the checkpoint has. Here each data-parallel "
                        "implementation loads its own --ckpt-format (said at start-up); convert the other with "
                        "tools/checkpoint/convert.py")
    g.add_argument("--dist-ckpt-strictness", choices=STRICTNESS, default="assume_ok_unexpected",
                   help="key mismatches on load. Here loads always stop on missing or unexpected keys "
                        "(raise_all); a value that would continue is said at start-up")
    add_non_persistent_args(g)
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="torch_dist saves of the DistributedOptimizer: its state per parameter in model space "
                        "(loads at any TP/PP/DP) instead of Megatron-LM's default dp_reshardable flat buckets. "
                        "fsdp_dtensor's optimizer state is always per parameter")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="do not stop on a NaN gradient")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   help="stop on a NaN gradient (default: on)")


def _fail(message: str) -> None:
    raise ArgumentError(message)


def validate_compat(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for these flags, and one line for each that is not implemented."""
    if args.overlap_param_gather and not (args.use_distributed_optimizer or args.use_megatron_fsdp):
        _fail("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp), as in Megatron-LM")
    _validate_data_parallel_tuning(args)
    _validate_cuda_only(args)
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        _fail("--no-position-embedding is deprecated (Megatron-LM refuses it too unless --position-embedding-type "
              "rope, where it has no effect): use --position-embedding-type none")
    if args.layernorm_zero_centered_gamma and _cuda() and args.transformer_impl == "local" \
            and importlib.util.find_spec("apex") is None:
        _fail("--apply-layernorm-1p on CUDA needs apex (FusedLayerNorm) or --transformer-impl transformer_engine: "
              "Megatron-Core's torch norm has no zero-centred gamma")
    if args.recompute_modules is not None and args.recompute_granularity != "selective":
        _fail("--recompute-modules needs --recompute-granularity selective")
    if args.recompute_modules and "moe_act" in args.recompute_modules and not args.moe_grouped_gemm:
        _fail("--recompute-modules moe_act needs --moe-grouped-gemm (Megatron-Core's rule)")
    if args.recompute_modules and "mla_up_proj" in args.recompute_modules and not args.multi_latent_attention:
        _fail("--recompute-modules mla_up_proj needs --multi-latent-attention")
    if args.manual_gc_interval < 0:
        _fail(f"--manual-gc-interval={args.manual_gc_interval} must be at least 0")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins < 0:
        _fail(f"--exit-duration-in-mins={args.exit_duration_in_mins} must be at least 0")
    validate_non_persistent(args)
    _validate_split_paths(args)
    if args.log_memory_to_tensorboard and not (args.tensorboard_dir or args.wandb_project):
        _fail("--log-memory-to-tensorboard needs --tensorboard-dir (or --wandb-project) to write to")
    if args.log_validation_ppl_to_tensorboard and not (args.tensorboard_dir or args.wandb_project):
        _fail("--log-validation-ppl-to-tensorboard needs --tensorboard-dir (or --wandb-project) to write to")
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)
    if args.enable_experimental:
        from megatron.core.config import set_experimental_flag

        set_experimental_flag(True)


def _validate_data_parallel_tuning(args: argparse.Namespace) -> None:
    """The DDP buckets, gather alignment and gather-in-step flags: Megatron-LM's rules, in its order."""
    if args.ddp_bucket_size is not None and args.ddp_num_buckets is not None:
        _fail("--ddp-bucket-size and --ddp-num-buckets both size the gradient buckets (Megatron-Core's rule): give one")
    for flag, value in (("--ddp-bucket-size", args.ddp_bucket_size), ("--ddp-num-buckets", args.ddp_num_buckets)):
        if value is not None and value < 1:
            _fail(f"{flag} {value} must be at least 1")
    if args.virtual_pipeline_model_parallel_size is None:
        args.align_param_gather = False  # Megatron-LM: only the interleaved schedule aligns gathers
    if args.overlap_param_gather_with_optimizer_step:
        for needed, rule in ((args.use_distributed_optimizer, "needs the distributed optimizer "
                                                               "(--use-distributed-optimizer)"),
                             (args.overlap_param_gather, "needs --overlap-param-gather"),
                             (args.virtual_pipeline_model_parallel_size is not None,
                              "needs virtual pipeline stages (--num-layers-per-virtual-pipeline-stage)"),
                             (False, f"is not supported with distributed checkpointing (--ckpt-format "
                                     f"{args.ckpt_format or 'torch_dist'}) but only with --ckpt-format torch, which "
                                     "this job does not implement: drop it")):
            if not needed:
                _fail(f"--overlap-param-gather-with-optimizer-step {rule} (Megatron-LM's rule)")


def _validate_cuda_only(args: argparse.Namespace) -> None:
    """CUDA features not implemented here: on CPU said in the substitution line, on CUDA refused."""
    if args.memory_snapshot_path is not None and not args.record_memory_history:
        _fail("--memory-snapshot-path is where --record-memory-history writes: add --record-memory-history or drop it")
    if not _cuda():
        return
    if args.cuda_graph_impl != "none":
        _fail(f"--cuda-graph-impl {args.cuda_graph_impl}: CUDA graphs are not implemented by this job; drop it "
              "(--cuda-graph-impl none)")
    if args.record_memory_history:
        _fail("--record-memory-history (torch.cuda.memory snapshots) is not implemented by this job; drop it")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _validate_split_paths(args: argparse.Namespace) -> None:
    given = [s for s in ("train", "valid", "test") if getattr(args, f"{s}_data_path")]
    if not given:
        return
    if args.data_path:
        _fail("--data-path and --train-data-path/--valid-data-path/--test-data-path are exclusive (Megatron-LM's "
              "rule): give one of them")
    if "train" not in given:
        _fail("--valid-data-path/--test-data-path need --train-data-path")
    if not args.tokenizer_type:
        _fail("--train-data-path needs --tokenizer-type (and its files) to know the vocabulary")


def transformer_config_fields(args, cpu: bool) -> dict:
    """The TransformerConfig fields of these flags (Megatron-LM's core_transformer_config_from_args).

    Fused kernels need CUDA (and apex / Transformer Engine for some): on CPU every fusion is
    off, which computes the same function.
    """
    have_te = args.transformer_impl == "transformer_engine"
    bias_fusion = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion
    return dict(
        masked_softmax_fusion=args.masked_softmax_fusion and not cpu,
        # Megatron-LM turns the bias-GeLU fusion off with --disable-bias-linear (SwiGLU's works without a bias).
        bias_activation_fusion=bias_fusion and (args.add_bias_linear or args.swiglu) and not cpu,
        apply_rope_fusion=args.apply_rope_fusion and have_te and args.position_embedding_type == "rope",
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion and not cpu,
        layernorm_zero_centered_gamma=args.layernorm_zero_centered_gamma,
        recompute_modules=args.recompute_modules,
        **_attention_backend(args),
    )


def _attention_backend(args) -> dict:
    from megatron.core.transformer.enums import AttnBackend

    return dict(attention_backend=AttnBackend[args.attention_backend])


def compat_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """What runs instead of the kernels these flags ask for, when this machine lacks them."""
    cpu = not _cuda()
    te = args.transformer_impl == "transformer_engine"
    out = []
    if getattr(args, "transformer_impl_requested", None) not in (None, args.transformer_impl):
        out.append(Substitution(f"--transformer-impl {args.transformer_impl_requested}",
                                f"--transformer-impl {args.transformer_impl} (Megatron-Core's own layers)",
                                "Transformer Engine not installed"))
    attention = "PyTorch SDPA" if cpu else "Megatron-Core's local DotProductAttention"
    if args.attention_backend not in ("auto", "local") and (cpu or not te):
        out.append(Substitution(f"--attention-backend {args.attention_backend}", attention,
                                "no CUDA" if cpu else "Transformer Engine not used"))
    if args.use_flash_attn:
        why = "no CUDA" if cpu else ("flash-attn not installed" if importlib.util.find_spec("flash_attn") is None
                                     else "Megatron-LM no longer reads this flag")
        out.append(Substitution("--use-flash-attn", attention, why))
    if args.cross_entropy_loss_fusion and cpu:
        out.append(Substitution("--cross-entropy-loss-fusion", "unfused vocab-parallel cross entropy", "no CUDA"))
    if args.tiktoken_pattern and args.tokenizer_type != "TikTokenizer":
        out.append(Substitution(f"--tiktoken-pattern {args.tiktoken_pattern}", "not read",
                                f"only TikTokenizer reads it, the tokenizer is {args.tokenizer_type}"))
    if args.empty_unused_memory_level and cpu:
        out.append(Substitution(f"--empty-unused-memory-level {args.empty_unused_memory_level}", "nothing",
                                "no CUDA caching allocator on CPU"))
    if args.auto_detect_ckpt_format:
        out.append(Substitution("--auto-detect-ckpt-format", f"--ckpt-format {args.ckpt_format}",
                                "each data-parallel implementation loads its own format; convert with "
                                "tools/checkpoint/convert.py"))
    if args.dist_ckpt_strictness not in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
        out.append(Substitution(f"--dist-ckpt-strictness {args.dist_ckpt_strictness}", "raise_all",
                                "a load never continues with missing or unexpected keys"))
    if args.use_mcore_models:
        out.append(Substitution("--use-mcore-models", "nothing", "models are always Megatron-Core's"))
    if args.cuda_graph_impl != "none" and cpu:
        out.append(Substitution(f"--cuda-graph-impl {args.cuda_graph_impl}", "no CUDA graphs", "no CUDA"))
    if args.record_memory_history and cpu:
        out.append(Substitution("--record-memory-history", "nothing recorded",
                                "no CUDA caching allocator on CPU; the log's peak memory per rank is the resident set"))
    if args.num_workers:
        out.append(Substitution(f"--num-workers {args.num_workers}", "samples read in the training process",
                                "the job's data iterator has no worker processes"))
    if args.use_megatron_fsdp:
        for flag, value in (("--ddp-bucket-size", args.ddp_bucket_size), ("--ddp-num-buckets", args.ddp_num_buckets)):
            if value is not None:
                out.append(Substitution(f"{flag} {value}", "one reduction per FSDP unit",
                                        "megatron.fsdp reduces each unit's gradients together"))
    return out + [Substitution(*line) for line in non_persistent_substitutions(args)]
