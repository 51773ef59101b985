"""A DeepSeek-V3-shaped tiny model for pretrain_gpt.py (tests/training/test_deepseek.py, docs/moe.md).

Every piece of DeepSeek-V3's shape at the smallest size that still exercises it: multi-latent
attention (low-rank query and key/value projections with their norms, YaRN RoPE on a separate
head part), one multi-token prediction layer, a dense first layer then MoE, 8 experts with one
shared expert, sigmoid routing with the learned expert bias, group-limited top-2 (2 of 4
groups), a top-k scaling factor, the sequence-level auxiliary loss. No dropout, so runs on
other layouts match.
"""

DEEPSEEK_MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "10",
    "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
    "--mock-data", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1", "--seed", "7",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--qk-layernorm",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rotary-scaling-factor", "40", "--mscale", "1.0",
    "--mscale-all-dim", "1.0",
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
    "--num-experts", "8", "--moe-layer-freq", "[0]*1+[1]*1", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
]


def dispatcher(name: str, ep: int):
    """The token dispatcher and expert-parallel size (``flex``: substituted by alltoall on this machine)."""
    return ["--moe-token-dispatcher-type", name, "--expert-model-parallel-size", str(ep)]


def meta_build_equals_eager(ctx, argv) -> list:
    """Build the job's model twice in the pool, eagerly and with --init-model-with-meta-device, and name
    every unit storage or buffer that differs (bitwise) on this rank: empty when the builds are equal."""
    import torch

    from megatron.fsdp_training.job_setup import setup
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    built = []
    for extra in ([], ["--init-model-with-meta-device"]):
        with megatron_case():
            _device, _tokenizer, model, _optimizer, _scheduler = setup(parse_args(argv + extra))
            state = {}
            for k, chunk in enumerate(model):
                state.update({f"{k}/{u.name}": u.storage.main.clone() for u in chunk.fsdp.units})
                state.update({f"{k}/buffer {n}": b.clone() for n, b in chunk.fsdp.module.named_buffers()})
            built.append(state)
    eager, meta = built
    return sorted(set(eager) ^ set(meta)) + [k for k in eager if k in meta and not torch.equal(eager[k], meta[k])]
