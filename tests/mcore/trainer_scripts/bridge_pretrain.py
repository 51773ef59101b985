"""Megatron-Bridge 0.6.2's ``pretrain(cfg, forward_step)`` on a tiny GPT, as a Bridge user writes it, for the tests.

    python bridge_pretrain.py [--fsdp LEVEL] [--gelu] [--tp N] [--pp N] [--tied] [--overlap] [--moe] [--iters N]
                              [--save DIR --save-interval N] [--load DIR [--ckpt-step N]] [--data-cache DIR]

``--fsdp LEVEL``: Bridge's Megatron-FSDP recipe (``cfg.ddp.use_megatron_fsdp = True``, the level,
``average_in_collective = False``, ``ckpt_format = "fsdp_dtensor"``); without it, Megatron-Core's DDP. Both call
``bridge.install()`` before ``pretrain`` (on this machine it also makes Bridge run on CPU). ``--pp N``: N pipeline
stages; ``--tied``: the embedding shared with the output layer (on the last stage under ``--pp``); ``--overlap``:
``overlap_grad_reduce`` (and with ``--fsdp`` ``overlap_param_gather``). Every iteration's loss (Bridge's
DP-reduced ``lm loss``, known on the last stage) and grad norm go to ``$LOSSES_DIR/rank<r>.json`` from each rank
that has the loss. The test harness
installs the stand-ins (``bridge_standins.py``) first.
"""

import argparse
import json
import os

import torch


def config(args):
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, LoggerConfig,
        MockGPTDatasetConfig, OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig, TrainingConfig,
        ValidationConfig)

    from megatron.fsdp.mcore_cpu.layer_spec import cpu_layer_spec

    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, seq_length=32, vocab_size=128,
        make_vocab_size_divisible_by=128, bf16=False, fp16=False, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, autocast_dtype=torch.float32, transformer_layer_spec=cpu_layer_spec,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False,
        cross_entropy_fusion_impl="native", cuda_graph_impl="none", attention_dropout=0.0, hidden_dropout=0.0,
        position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
        share_embeddings_and_output_weights=args.tied, use_cpu_initialization=True,
        gated_linear_unit=not args.gelu,
        activation_func=torch.nn.functional.gelu if args.gelu else torch.nn.functional.silu,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, sequence_parallel=False)
    if args.moe:  # 4 experts over 2 expert-parallel ranks, top-2, all-to-all
        model.num_moe_experts, model.expert_model_parallel_size, model.moe_router_topk = 4, 2, 2
        model.moe_token_dispatcher_type, model.moe_ffn_hidden_size = "alltoall", 128
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=args.iters, global_batch_size=8, micro_batch_size=2, exit_signal_handler=False),
        validation=ValidationConfig(eval_interval=1000, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, adam_beta1=0.9,
                                  adam_beta2=0.95, adam_eps=1e-8, bf16=False, fp16=False, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=1, lr_decay_iters=6,
                                  start_weight_decay=0.01, end_weight_decay=0.01, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(check_for_nan_in_grad=True, overlap_grad_reduce=args.overlap),
        dataset=MockGPTDatasetConfig(seq_length=32, random_seed=1234, reset_position_ids=False,
                                     reset_attention_mask=False, eod_mask_loss=False, num_workers=0,
                                     dataloader_type="single", split="1,1,1", path_to_cache=args.data_cache),
        logger=LoggerConfig(log_interval=1, tensorboard_dir=None, log_timers_to_tensorboard=False),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        checkpoint=CheckpointConfig(save=args.save, save_interval=args.save_interval, load=args.load,
                                    ckpt_step=args.ckpt_step,
                                    async_save=False, fully_parallel_save=False, fully_parallel_load=False),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(use_gloo_process_groups=True),
        mixed_precision=None)
    if args.fsdp:  # the design notes' recipe (Bridge's perf-megatron-fsdp skill)
        cfg.dist.use_megatron_fsdp = True
        cfg.ddp.use_megatron_fsdp = True
        cfg.ddp.data_parallel_sharding_strategy = args.fsdp
        cfg.ddp.average_in_collective = False
        cfg.ddp.overlap_param_gather = args.overlap
        cfg.checkpoint.ckpt_format = "fsdp_dtensor"
    return cfg


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp", default=None)
    parser.add_argument("--gelu", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--data-cache", default=None, help="the dataset indices' cache folder (path_to_cache)")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--save", default=None)
    parser.add_argument("--save-interval", type=int, default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--ckpt-step", type=int, default=None)
    args = parser.parse_args()
    from megatron.fsdp.mcore import bridge

    bridge.install()  # use_megatron_fsdp=True means this backend; without a GPU, Bridge runs on CPU (DDP too)
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    records = []

    def on_train_step_end(context):
        losses = {k: float(v) for k, v in (context.loss_dict or {}).items()}
        if "lm loss" in losses:  # (the pipeline's last stage)
            records.append([context.state.train_state.step, losses["lm loss"], float(context.grad_norm)])

    callbacks = CallbackManager()
    callbacks.register("on_train_step_end", on_train_step_end)
    pretrain(config(args), forward_step, callbacks=callbacks)
    if os.environ.get("LOSSES_DIR") and records:  # (Bridge destroyed the groups)
        with open(os.path.join(os.environ["LOSSES_DIR"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(records, f)


if __name__ == "__main__":
    main()
