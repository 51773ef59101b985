"""megatron.fsdp.precision.fp8: formats, scales, delayed-scaling histories, MXFP8 and blockwise (one process)."""

import pytest
import torch

from megatron.fsdp.precision import fp8


def test_formats_and_saturating_cast():
    assert (fp8.E4M3.max, fp8.E5M2.max) == (448.0, 57344.0)
    assert fp8.fp8_format("e5m2").dtype is torch.float8_e5m2
    with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'"):
        fp8.fp8_format("e3m4")
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        fp8.check_recipe("nvfp4")
    x = torch.tensor([1000.0, -1000.0, 1.0, 0.0])
    q = fp8.quantize_per_tensor(x, torch.tensor(1.0), "e4m3")
    assert q.data.dtype is torch.float8_e4m3fn and q.data.float().tolist() == [448.0, -448.0, 1.0, 0.0]
    q = fp8.quantize_per_tensor(torch.tensor([1e6, 2.0]), torch.tensor(0.5), "e5m2")  # e5m2 has inf: saturate anyway
    assert q.data.float().tolist() == [57344.0, 1.0] and q.scale_inv.item() == 2.0
    assert q.dequantize().tolist() == [114688.0, 2.0]
    assert fp8.amax(torch.empty(0)).item() == 0.0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_decode_is_the_cast_for_every_code(fmt):
    """The lookup ``dequantize`` decodes with is torch's cast, bit for bit, for each of the 256 codes (NaNs too),
    whatever the shape or the tensor's layout."""
    dtype = fp8.fp8_format(fmt).dtype
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    assert torch.equal(fp8.decode(codes).view(torch.int32), codes.to(torch.float32).view(torch.int32))
    grid = codes.reshape(16, 16).t()  # not contiguous
    assert torch.equal(fp8.decode(grid).view(torch.int32), grid.to(torch.float32).view(torch.int32))
    assert fp8.decode(codes[:0]).shape == (0,)


def test_scale_from_amax_follows_transformer_engine():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-45])
    previous = torch.full((5,), 3.0)
    scale = fp8.scale_from_amax(amax, "e4m3", margin=1, previous=previous)
    assert scale.tolist()[:4] == [112.0, 3.0, 3.0, 3.0]  # 448 / 2 / 2**1; amax 0 / inf / nan keep the old scale
    assert scale[4].item() == torch.finfo(torch.float32).max  # overflow -> fp32 max
    assert fp8.scale_from_amax(torch.tensor(0.0), "e4m3").item() == 1.0  # no previous: 1
    w = torch.randn(64, 32)
    q = fp8.quantize_tensorwise(w, "e4m3")
    assert q.data.float().abs().max().item() == 448.0  # the largest element lands on the format's max
    assert torch.allclose(q.dequantize(), w, rtol=2 ** -3, atol=1e-3 * w.abs().max().item())


def test_amax_history_window_and_the_scale_each_step_uses():
    steps = [torch.tensor(a) for a in (4.0, 8.0, 2.0, 1.0, 0.0, 16.0)]
    for algo, length in (("max", 3), ("most_recent", 3), ("max", 1)):
        history = fp8.AmaxHistory.new(length, algo)
        used, recorded = [], []
        for a in steps:
            used.append(history.scale.item())
            history = history.record(a).record(a / 2)  # two quantizations in one step record the max
            recorded.append(a.item())
            history = history.advance("e4m3")
        expected, previous = [1.0], 1.0
        for i in range(1, len(steps)):
            window = recorded[max(0, i - length):i] if algo == "max" else [recorded[i - 1]]
            previous = 448.0 / max(window) if max(window) > 0 else previous
            expected.append(previous)
        assert used == expected, (algo, length, used, expected)
    batched = fp8.AmaxHistory.new(4, shape=(2,)).record(torch.tensor([1.0, 7.0])).advance("e5m2", margin=2)
    assert batched.scale.tolist() == [57344.0 / 4, 57344.0 / 7 / 4] and batched.amaxes[-1].tolist() == [1.0, 7.0]
    q, history = fp8.quantize_delayed(torch.tensor([3.0, -5.0]), fp8.AmaxHistory.new(2), "e4m3")
    assert q.recipe == "delayed" and q.scale_inv.item() == 1.0 and history.amaxes[0].item() == 5.0
    with pytest.raises(ValueError, match="amax_compute_algo"):
        fp8.AmaxHistory.new(2, "mean")


def test_mxfp8_power_of_two_scales_never_saturate_and_dequantize_exactly_in_bf16():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g) * torch.logspace(-6, 3, 6).unsqueeze(1)
    w[0, :32] = 0.0  # an all-zero block
    w[1, 0] = 460.0  # just above 448: TE's round-up takes scale 2 (OCP's floor would saturate)
    q = fp8.quantize_mxfp8(w, "e4m3")
    assert q.data.shape == w.shape and q.scale_inv.shape == (6, 3) and q.scale_inv.dtype is torch.float8_e8m0fnu
    scales = q.scale_inv.float()
    blocks = w.view(6, 3, 32)
    block_amax = blocks.abs().amax(-1)
    nonzero = block_amax > 0
    assert torch.all(torch.log2(scales) == torch.round(torch.log2(scales)))  # powers of two
    assert torch.all(block_amax[nonzero] / scales[nonzero] <= 448.0)  # no block saturates
    assert torch.all(block_amax[nonzero] / (scales[nonzero] / 2) > 448.0)  # and each scale is the smallest such
    assert scales[1, 0].item() == 2.0
    assert torch.equal(q.dequantize(torch.bfloat16).float(), q.dequantize(torch.float32))  # exact in bf16
    assert q.dequantize()[0, :32].abs().max().item() == 0.0
    error = (q.dequantize() - w).abs().view(6, 3, 32)  # round to nearest: half a step, E4M3 subnormals 2**-9 apart
    assert torch.all(error <= blocks.abs() / 16 + scales.unsqueeze(-1) * 2 ** -10)
    # blocks along dim 0 are the transposed tensor's blocks along its last dim
    col = fp8.quantize_mxfp8(w.T.contiguous(), dim=0)
    assert col.block_dim == 0 and torch.equal(col.data.T.float(), q.data.float())
    assert torch.equal(col.scale_inv.T.float(), scales) and torch.equal(col.dequantize().T, q.dequantize())
    assert q.nbytes == 6 * 96 + 6 * 3
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8.quantize_mxfp8(torch.ones(4, 40))


def test_blockwise_tiles():
    w = torch.randn(200, 130) * 0.02
    w[:128, :128] = 0.0
    q = fp8.quantize_blockwise(w)
    assert q.data.shape == (200, 130) and q.scale_inv.shape == (2, 2) and q.scale_inv[0, 0].item() == 1.0
    s = q.scale_inv
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))
    tile_scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :130]
    assert torch.all((q.dequantize() - w).abs() <= w.abs() / 16 + tile_scale * 2 ** -10)
    assert (q.dequantize()[:128, :128] == 0).all()
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_blockwise(torch.ones(3))
