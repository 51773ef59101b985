"""The CPU FP8 GEMMs (megatron/fsdp/mcore_cpu/fp8_matmul.py): each GEMM's operands quantized as the recipe says, and the
layer spec that puts the FP8 linears where Megatron-Core's local linears were."""

import functools

import pytest
import torch

from megatron.fsdp.mcore_cpu.fp8_matmul import Fp8Recipe, fp8_linear
from megatron.fsdp.precision import fp8


def _quantizer(recipe, calls):
    def quantize(role, tensor, dim):
        fmt = recipe.format_of(role)
        calls.append((role, fmt, dim, tuple(tensor.shape)))
        if recipe.recipe == "mxfp8":
            return fp8.quantize_mxfp8(tensor, fmt, dim)
        return fp8.quantize_tensorwise(tensor, fmt)
    return quantize


def _assert_product(actual, a, b, bias=None, *, per_tensor: bool):
    """``actual`` is ``a @ b (+ bias)`` of the dequantized operands.

    MXFP8 GEMMs dequantize and multiply with torch's fp32 matmul, as this reference does: bitwise. Per-tensor
    GEMMs run ``torch._scaled_mm``, whose CPU kernel accumulates in fp32 in an order of its own (bitwise the fp32
    matmul's with oneDNN off, as the layers call it; oneDNN's FP8 kernel on an Intel Xeon with AMX sums in another
    order, up to ~4 fp32 roundings of the terms apart): there the
    product is within the accumulation bound ``(n + 1) u sum|a||b|`` (n the reduction length, u = 2^-24; the
    bias's addition the + 1) of the exact one, plus the final rounding to ``actual``'s dtype. A wrong operand
    quantization moves elements by an FP8 step (2^-3 relative for E4M3), far outside it.
    """
    want = a @ b + (0 if bias is None else bias)
    if not per_tensor:
        assert torch.equal(actual, want.to(actual.dtype))
        return
    exact = a.double() @ b.double() + (0 if bias is None else bias.double())
    magnitude = a.abs().double() @ b.abs().double() + (0 if bias is None else bias.abs().double())
    bound = (a.shape[1] + 1) * 2.0 ** -24 * magnitude + torch.finfo(actual.dtype).eps * exact.abs()
    excess = (actual.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements outside fp32 accumulation of the product"


@pytest.mark.parametrize("recipe, fmt, wgrad, dtype", [
    ("tensorwise", "hybrid", True, torch.bfloat16), ("tensorwise", "e4m3", False, torch.float32),
    ("mxfp8", "hybrid", True, torch.bfloat16), ("mxfp8", "e4m3", True, torch.float32)])
def test_each_gemm_multiplies_the_operands_the_recipe_quantizes(recipe, fmt, wgrad, dtype):
    """Forward x W^T (+ b in fp32, one rounding), dgrad dy W, wgrad dy^T x: each equal to the product of the
    dequantized operands; inputs and weights E4M3, gradients E5M2 under hybrid; mxfp8 blocks along each GEMM's
    reduction dimension, the tokens (40 here) zero-padded to whole blocks; --no-fp8-wgrad in the compute dtype."""
    r = Fp8Recipe(format=fmt, recipe=recipe, wgrad=wgrad)
    calls = []
    quantize = _quantizer(r, calls)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, 64, generator=generator).to(dtype).requires_grad_()
    w = torch.randn(96, 64, generator=generator).to(dtype).requires_grad_()
    b = torch.randn(96, generator=generator).to(dtype).requires_grad_()
    y = fp8_linear(x, w, b, r, quantize, lambda weight, dim: quantize("weight", weight, dim))
    dy = torch.randn(y.shape, generator=generator).to(dtype)
    y.backward(dy)
    grad = "e5m2" if fmt == "hybrid" else "e4m3"
    x2, dy2, wd = x.detach().reshape(40, 64), dy.reshape(40, 96), w.detach()

    def q(role, t, dim):
        return _quantizer(r, [])(role, t, dim).dequantize()

    per_tensor = recipe == "tensorwise"
    _assert_product(y.detach().reshape(40, 96), q("input", x2, 1), q("weight", wd, 1).t(), b.float(),
                    per_tensor=per_tensor)
    _assert_product(x.grad.reshape(40, 64), q("grad", dy2, 1), q("weight", wd, 0 if recipe == "mxfp8" else 1),
                    per_tensor=per_tensor)
    if not wgrad:
        assert torch.equal(w.grad, dy2.t() @ x2)
    elif recipe == "mxfp8":
        pad = torch.nn.functional.pad
        _assert_product(w.grad, q("grad", pad(dy2, (0, 0, 0, 24)), 0).t(), q("input", pad(x2, (0, 0, 0, 24)), 0),
                        per_tensor=False)
    else:
        _assert_product(w.grad, q("grad", dy2, 1).t(), q("input", x2, 1), per_tensor=True)
    assert torch.equal(b.grad, dy2.sum(0, dtype=torch.float32).to(dtype))
    assert {role: f for role, f, _, _ in calls} == {"input": "e4m3", "weight": "e4m3", "grad": grad}
    if recipe == "mxfp8":  # the blocks' dimension of each operand, padded token counts for the weight gradient
        assert sorted(set(calls)) == sorted({("input", "e4m3", 1, (40, 64)), ("weight", "e4m3", 1, (96, 64)),
                                             ("grad", grad, 1, (40, 96)), ("weight", "e4m3", 0, (96, 64)),
                                             ("grad", grad, 0, (64, 96)), ("input", "e4m3", 0, (64, 64))})


def test_scaled_mm_is_the_dequantized_product_and_an_expert_without_tokens_multiplies_nothing():
    r = Fp8Recipe(format="hybrid", recipe="tensorwise")
    quantize = _quantizer(r, [])
    for rows in (0, 7):
        x = torch.randn(rows, 32, requires_grad=True)
        w = torch.randn(16, 32, requires_grad=True)
        y = fp8_linear(x, w, None, r, quantize, lambda weight, dim: quantize("weight", weight, dim))
        y.sum().backward()
        assert y.shape == (rows, 16) and w.grad.shape == (16, 32) and x.grad.shape == (rows, 32)
        if rows:
            _assert_product(y.detach(), quantize("input", x.detach(), 1).dequantize(),
                            quantize("weight", w.detach(), 1).dequantize().t(), per_tensor=True)
        else:
            assert not w.grad.any()


def test_the_fp8_spec_replaces_every_local_linear_and_keeps_the_first_and_last_layers_as_asked():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron.fsdp.mcore_cpu.fp8_linears import Fp8ColumnParallelLinear, Fp8RowParallelLinear, fp8_layer_spec

    recipe = Fp8Recipe(recipe="mxfp8", layers_at_start_in_bf16=1, layers_at_end_in_bf16=2)
    found = []

    def walk(spec):
        # megatron-core >= 0.17 gives the MLP as functools.partial(MLP.as_mlp_submodule, submodules=...)
        sub = spec.keywords.get("submodules") if isinstance(spec, functools.partial) else getattr(spec, "submodules", None)
        for name in getattr(sub, "__dataclass_fields__", {}):
            value = getattr(sub, name)
            if isinstance(value, ModuleSpec):
                if value.module in (Fp8ColumnParallelLinear, Fp8RowParallelLinear):
                    assert value.params["fp8_recipe"] is recipe
                    found.append(name)
                walk(value)
            elif isinstance(value, functools.partial):
                walk(value)
            assert value not in (ColumnParallelLinear, RowParallelLinear), name

    for spec, names in ((get_gpt_layer_local_spec(), ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
                        (get_gpt_layer_local_spec(num_experts=4, multi_latent_attention=True),
                         ["linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                          "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2", "linear_fc1", "linear_fc2"])):
        found.clear()
        walk(fp8_layer_spec(spec, recipe))
        assert sorted(found) == sorted(names)  # field order differs between megatron-core releases
    assert [recipe.in_fp8(i, 6) for i in range(6)] == [False, True, True, True, False, False]
