"""Cases for tests/training/test_llama.py that run inside a gloo pool."""

from __future__ import annotations

from typing import List


def local_spec_matches_cpu_spec(ctx, argv: List[str]) -> dict:
    """Build the model twice from the same seed: with the CPU spec, and with the block spec a GPU run
    builds (Megatron-Core's ``get_gpt_decoder_block_spec``, local layers: DotProductAttention, its
    norms); returns the layer types and the largest logit difference on one batch."""
    import torch

    from megatron.core import parallel_state as ps
    from megatron.fsdp.mcore_cpu.cuda_standins import enable_cpu_mode
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.model_shape import gpt_model_fields
    from megatron.fsdp_training.arguments import parse_args, validate_args
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    with megatron_case():
        args = validate_args(parse_args(argv), ctx.size)
        ps.initialize_model_parallel()
        config = model_lib.transformer_config(args, cpu=True)
        seq = args.seq_length
        tokens = torch.arange(2 * seq).reshape(2, seq) % 128
        positions = torch.arange(seq).expand(2, seq)
        mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
        result = {}
        for name, cpu in (("cpu", True), ("local", False)):
            enable_cpu_mode(args.seed)
            torch.manual_seed(args.seed)
            spec = model_lib._layer_spec(args, config, cpu, None)
            model = model_lib.gpt_chunks(config, lambda vp_stage: spec, 128, seq, **gpt_model_fields(args))[0]
            result[name] = {"layers": [type(layer.mlp).__name__ for layer in model.decoder.layers],
                            "attention": type(model.decoder.layers[0].self_attention.core_attention).__name__,
                            "logits": model(tokens, positions, mask).detach()}
        result["max_diff"] = (result["cpu"].pop("logits") - result["local"].pop("logits")).abs().max().item()
        return result
