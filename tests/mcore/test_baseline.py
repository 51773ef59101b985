"""The Megatron-Core baseline the adapter's parity is measured against, checked on its own.

Megatron-Core's DistributedDataParallel + optimizer train the tiny GPT on 4 CPU ranks in
every topology the adapter supports: losses are finite, the same on every rank and fall;
DDP and the DistributedOptimizer agree; and independent decompositions of the same math
(TP 2 with and without sequence parallel, CP 2) give the same losses, which checks the CPU
attention and norm against TP=1/CP=1 math. ``megatron.core`` is imported in the workers only.
"""

import math

import pytest

from tests.cases.baselines import MICRO_BATCHES, STEPS, megatron_ddp
from megatron.fsdp_training.testing.gpt import TOPOLOGIES, Topology, megatron_ddp_run


def _baseline(pool, name, use_distributed_optimizer=False):
    """Per-rank results; each run happens once per session (shared with the adapter's tests)."""
    return megatron_ddp(pool, TOPOLOGIES[name], use_distributed_optimizer=use_distributed_optimizer)


def _max_rel_diff(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_baseline_trains(mcore_pool, name):
    per_rank = _baseline(mcore_pool, name)
    losses, norms = per_rank[0]["losses"], per_rank[0]["grad_norms"]
    assert len(losses) == len(norms) == STEPS
    assert all(math.isfinite(x) for x in losses + norms), per_rank[0]
    for rank, result in enumerate(per_rank):
        assert result == per_rank[0], f"rank {rank} disagrees: {result} vs {per_rank[0]}"
    # ln(128) = 4.85 at the start; the counting sequences are learnable.
    assert 4.7 < losses[0] < 5.0, losses
    assert losses[-1] < losses[0] - 0.1, losses  # ~0.14 after 3 steps (lr 2e-3)
    assert all(b < a + 0.02 for a, b in zip(losses, losses[1:])), losses


@pytest.mark.parametrize("name", ["dp4", "tp2-dp2"])
def test_ddp_matches_distributed_optimizer(mcore_pool, name):
    ddp = _baseline(mcore_pool, name)[0]
    distopt_per_rank = _baseline(mcore_pool, name, use_distributed_optimizer=True)
    assert all(r == distopt_per_rank[0] for r in distopt_per_rank)
    distopt = distopt_per_rank[0]
    assert _max_rel_diff(distopt["losses"], ddp["losses"]) <= 1e-5, (distopt, ddp)
    assert _max_rel_diff(distopt["grad_norms"], ddp["grad_norms"]) <= 1e-4, (distopt, ddp)


def test_overlapped_communication_matches(mcore_pool):
    """The schedule hooks (no_sync, grad/param sync per chunk) with Megatron's overlap paths on."""
    plain = _baseline(mcore_pool, "pp2-vpp2-dp2")[0]
    overlapped = mcore_pool.run(megatron_ddp_run, timeout=300,
                                topology=TOPOLOGIES["pp2-vpp2-dp2"], steps=STEPS,
                                micro_batches=MICRO_BATCHES, use_distributed_optimizer=True,
                                overlap_grad_reduce=True, overlap_param_gather=True,
                                align_param_gather=True)[0]
    assert _max_rel_diff(overlapped["losses"], plain["losses"]) <= 1e-5, (overlapped, plain)


def test_tensor_sequence_and_context_parallel_agree(mcore_pool):
    """TP 2, TP 2 + SP and CP 2 (all with DP 2, same data and weights) are the same math."""
    tp = _baseline(mcore_pool, "tp2-dp2")[0]
    for name in ("tp2sp-dp2", "cp2-dp2"):
        other = _baseline(mcore_pool, name)[0]
        assert _max_rel_diff(other["losses"], tp["losses"]) <= 1e-5, (name, other, tp)
        assert _max_rel_diff(other["grad_norms"], tp["grad_norms"]) <= 1e-4, (name, other, tp)


# ---------------------------------------------------------------- worker cases

def check_context_parallel_attention(ctx):
    """SDPACoreAttention under CP 2 vs full-sequence SDPA: outputs and q/k/v gradients."""
    import torch
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.fsdp.mcore_cpu.cuda_standins import SDPACoreAttention, _load_balanced_positions
    from megatron.fsdp_training.testing.gpt import parallel, tiny_gpt_config

    topology = Topology(cp=2)
    errors = {}
    with parallel(ctx, topology):
        attention = SDPACoreAttention(tiny_gpt_config(topology), layer_number=1,
                                      attn_mask_type=AttnMaskType.causal, attention_type="self")
        gen = torch.Generator().manual_seed(7)
        s, b, heads, dim = 16, 2, 4, 8
        full = [torch.randn(s, b, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3)]
        weight = torch.randn(s, b, heads * dim, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in full]
        q, k, v = (t.permute(1, 2, 0, 3) for t in ref_in)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        (ref * weight).sum().backward()

        cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        rows = _load_balanced_positions(cp, rank, s // (2 * cp))
        causal_mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(b, 1, s, s)
        for label, mask in (("no mask", None), ("explicit mask", causal_mask[:, :, rows])):
            local = [t.index_select(0, rows).clone().requires_grad_() for t in full]
            out = attention(*local, mask)
            (out * weight.index_select(0, rows)).sum().backward()
            errors[label] = max(
                [(out - ref.index_select(0, rows)).abs().max().item()]
                + [(t.grad - r.grad.index_select(0, rows)).abs().max().item()
                   for t, r in zip(local, ref_in)])
    return errors


def check_cpu_mode_switches(ctx):
    """Inside ``parallel`` CUDA requests land on the CPU; after it, nothing is left patched."""
    import torch

    from megatron.fsdp.mcore_cpu.cuda_standins import cpu_mode_enabled
    from megatron.fsdp_training.testing.gpt import parallel

    seen = {}
    with parallel(ctx, Topology()):
        seen["inside_enabled"] = cpu_mode_enabled()
        seen["inside_device"] = torch.empty(2, device="cuda").device.type
        seen["inside_type"] = torch.zeros(2).type()
    seen["after_enabled"] = cpu_mode_enabled()
    try:
        torch.empty(2, device="cuda")
        seen["after_cuda_alloc"] = "allowed"
    except (RuntimeError, AssertionError):
        seen["after_cuda_alloc"] = "raises"
    seen["after_type"] = torch.zeros(2).type()
    return seen


def test_context_parallel_attention_is_exact(mcore_pool):
    for errors in mcore_pool.run(check_context_parallel_attention,
                                 timeout=120):
        assert max(errors.values()) < 1e-12, errors


def test_cpu_mode_is_scoped_to_the_case(mcore_pool):
    for seen in mcore_pool.run(check_cpu_mode_switches, timeout=120):
        assert seen == {"inside_enabled": True, "inside_device": "cpu",
                        "inside_type": "torch.cuda.FloatTensor", "after_enabled": False,
                        "after_cuda_alloc": "raises", "after_type": "torch.FloatTensor"}, seen


def check_selective_recompute(ctx):
    """Megatron-Core's output-discarding recompute (``CheckpointWithoutOutput``, what ``--recompute-modules layernorm
    mla_up_proj moe_act`` use) against the same function without it: the recomputed output is what the matmul after
    it reads for its weight's gradient."""
    import torch
    from megatron.core.tensor_parallel import random as mcore_random

    from megatron.fsdp_training.testing.gpt import parallel

    with parallel(ctx, Topology()):
        torch.manual_seed(0)
        x, w, v = (torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True),
                   torch.randn(8, 3, requires_grad=True))
        (torch.nn.functional.gelu(x @ w) @ v).square().sum().backward()
        plain = [t.grad.clone() for t in (x, w, v)]
        for t in (x, w, v):
            t.grad = None
        recompute = mcore_random.CheckpointWithoutOutput()
        hidden = recompute.checkpoint(lambda a, b: torch.nn.functional.gelu(a @ b), x, w)
        out = hidden @ v
        recompute.discard_output_and_register_recompute(out)
        emptied = hidden.untyped_storage().nbytes()
        out.square().sum().backward()
        return {"emptied": emptied, "same": all(torch.equal(t.grad, g) for t, g in zip((x, w, v), plain)),
                "compiled": getattr(mcore_random, "_share_storage_ext", None) is not None}


def test_selective_recompute_refills_the_discarded_output_without_compiling(mcore_pool):
    for seen in mcore_pool.run(check_selective_recompute, timeout=120):
        assert seen == {"emptied": 0, "same": True, "compiled": False}, seen
