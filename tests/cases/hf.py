"""Worker side of tests/tools/test_hf_checkpoints.py: Megatron models inside the gloo pools."""

from __future__ import annotations

from typing import List

import torch


@torch.no_grad()
def megatron_logits(ctx, argv: List[str], model_file: str, tokens: torch.Tensor) -> dict:
    """Logits of the single-rank (TP 1) GPTModel of ``argv`` holding ``model_file`` (``to-torch --model-only``).

    Every rank builds the same model by itself (data parallel only: no collective in the forward).
    """
    from megatron.core import parallel_state as ps
    from megatron.fsdp.mcore_cpu.cuda_standins import enable_cpu_mode
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.arguments import parse_args, validate_args
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    state = torch.load(model_file, weights_only=False)
    vocab = state["embedding.word_embeddings.weight"].shape[0]
    with megatron_case():
        args = validate_args(parse_args(argv), ctx.size)
        ps.initialize_model_parallel()
        enable_cpu_mode(args.seed)
        config = model_lib.transformer_config(args, cpu=True)
        model = model_lib.build_model_chunks(args, config, vocab, cpu=True)[0]
        result = model.load_state_dict(state, strict=False)
        model.eval()
        seq = tokens.shape[1]
        positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        logits = model(tokens, positions, mask)
    return {"logits": logits if ctx.rank == 0 else None,
            "missing": [k for k in result.missing_keys if not k.endswith("_extra_state")],
            "unexpected": list(result.unexpected_keys)}


def finetune_first_batch(ctx, argv: List[str]) -> dict:
    """``pretrain`` of ``argv`` (``--load ... --finetune``), and the first global batch it trained on."""
    from megatron.fsdp_training.data import datasets as data
    from megatron.fsdp_training.arguments import parse_args, validate_args
    from megatron.fsdp_training.testing.pretrain import pretrain_in_pool

    history = pretrain_in_pool(ctx, argv)
    args = validate_args(parse_args(argv), ctx.size)
    tokenizer = data.build_tokenizer(args)
    train, _, _ = data.build_datasets(args, tokenizer)
    rows = [train[i] for i in range(args.global_batch_size)]
    batch = {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in ("tokens", "labels", "loss_mask")}
    return {"losses": history["losses"], "start_iteration": history["start_iteration"], **batch}


def megatron_logits_of_each(ctx, cases: List[dict]) -> List[dict]:
    """``megatron_logits`` of several models in one call (``cases``: its keyword arguments, one dict each)."""
    return [megatron_logits(ctx, **case) for case in cases]
