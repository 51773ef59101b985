"""FP8 cases for the Megatron pools (tests/training/test_fp8.py): the CPU FP8 layers' delayed scaling, checked
against values computed here from the inputs every rank saw, and the tiny model the parity runs train."""

from __future__ import annotations

from megatron.fsdp_training.testing.job import MODEL

# One micro-batch per rank and step on 2 ranks, no clipping: the gradient sums of DDP and of every
# megatron.fsdp level are then the same additions, so FP8 runs (whose rounding amplifies one-ulp
# differences) can be compared bitwise. fp32 compute: Megatron-Core's bf16 (Float16Module) and the
# engine's differ by bf16 roundings of their own.
FP8_PARITY = MODEL + ["--micro-batch-size", "4", "--global-batch-size", "8", "--clip-grad", "0"]


def delayed_scaling_case(ctx, history_len: int, algo: str) -> dict:
    """One ``Fp8ColumnParallelLinear`` (hybrid, delayed) on every rank of the pool, three training steps with
    rank-dependent inputs and a validation forward between them; returns what the layer holds and what it
    should hold (the max over ranks of each step's amaxes, TE's window and scale rule), and the GEMM output of
    the third step against the product of the operands quantized with the scales of step 2."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.fsdp.mcore_cpu.cuda_standins import enable_cpu_mode
    from megatron.fsdp.mcore_cpu.fp8_matmul import Fp8Recipe
    from megatron.fsdp.mcore_cpu.fp8_linears import Fp8ColumnParallelLinear, Fp8StepEnd
    from megatron.fsdp.precision import fp8
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    with megatron_case():
        ps.initialize_model_parallel()
        enable_cpu_mode(1)
        rank = dist.get_rank()
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                   gradient_accumulation_fusion=False)
        recipe = Fp8Recipe(format="hybrid", recipe="delayed", amax_history_len=history_len, amax_compute_algo=algo)
        torch.manual_seed(0)
        layer = Fp8ColumnParallelLinear(32, 64, config=config, init_method=torch.nn.init.normal_, bias=False,
                                        gather_output=False, fp8_recipe=recipe)
        step_end = Fp8StepEnd([layer])
        seen = {"input": [], "weight": [], "grad": []}  # the global amax of each step
        out = {}
        for step in range(3):
            generator = torch.Generator().manual_seed(100 * step + rank)
            x = (torch.randn(8, 2, 32, generator=generator) * (1 + rank + step)).requires_grad_()
            dy = torch.randn(8, 2, 64, generator=generator) * (3 - step + rank)
            scales = layer.fp8_forward_scale.clone(), layer.fp8_backward_scale.clone()
            y, _ = layer(x)
            y.backward(dy)
            if step == 2:
                qx = fp8.quantize_per_tensor(x.detach().reshape(-1, 32), scales[0][0], "e4m3")
                qw = fp8.quantize_per_tensor(layer.weight.detach(), scales[0][1], "e4m3")
                want = (qx.dequantize() @ qw.dequantize().t()).reshape(8, 2, 64)
                out["output_matches"] = torch.equal(y.detach(), want)
                qdy = fp8.quantize_per_tensor(dy.reshape(-1, 64), scales[1][0], "e5m2")
                out["dgrad_matches"] = torch.equal(x.grad.reshape(-1, 32), qdy.dequantize() @ qw.dequantize())
            for name, t in (("input", x), ("weight", layer.weight), ("grad", dy)):
                a = fp8.amax(t).reshape(1)
                dist.all_reduce(a, op=dist.ReduceOp.MAX)
                seen[name].append(float(a))
            layer.eval()
            with torch.no_grad():
                layer(torch.full((8, 2, 32), 1e4))  # validation: quantizes, records nothing
            layer.train()
            step_end()
        want_scales = []
        for name, fmt in (("input", 448.0), ("weight", 448.0), ("grad", 57344.0)):
            window = seen[name][-history_len:] if algo == "max" else seen[name][-1:]
            want_scales.append(fmt / max(window))
        out["scales"] = layer.fp8_forward_scale.tolist() + layer.fp8_backward_scale.tolist()
        out["want_scales"] = [float(torch.tensor(s, dtype=torch.float32)) for s in want_scales]
        out["history"] = layer.fp8_forward_history[:, 0].tolist()
        out["seen_input"] = seen["input"]
        layer.bfloat16()  # Megatron-Core's Float16Module: the weights become bf16, the scaling state stays fp32
        out["state_dtypes"] = sorted({str(b.dtype) for n, b in layer.named_buffers() if n.startswith("fp8_")})
        out["weight_dtype"] = str(layer.weight.dtype)
        out["ledger_gathers"] = step_end.ledger.calls("all_gather") if dist.get_world_size() > 1 else None
        return out
