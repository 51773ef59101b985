"""Checkpoint keys of pretrain_gpt.py: experts keyed by their global index (an MoE checkpoint at EP 2 loaded at
EP 1 and EP 4; grouped-GEMM experts at TP = expert TP 2 x EP 2 resumed at TP 1 x EP 4), layer numbers and tied
weights as global keys, each kind of TP shard at its place in the TP-global tensor, and the previous layout's
keys per TP rank read in TP-global coordinates (the committed layout-1 checkpoint, and one made in the pool).
"""

import math
import os
import tarfile
from typing import Dict

import pytest
import torch

from megatron.fsdp.mcore.checkpoint_keys import (ParallelRanks, chunk_keys, global_key, rename_optimizer_key,
                                                 split_placement, tp1_shape, tp_placements)
from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.checkpointing.layout_v1 import parse_key as parse_v1_key
from megatron.fsdp_training.testing.job import ROOT, fsdp
from megatron.fsdp_training.testing.pools import pool_of
from megatron.fsdp_training.tools.checkpoint_tools import inspect as ckpt_inspect
from tests.cases.job_runs import B8, MODEL, pretrain


def layout_v1_translation(ctx, directory: str) -> Dict[str, bool]:
    """A layout-1 checkpoint made here (EP 2 x expert TP 2 grouped-GEMM weights in their raw shapes, a TP-split
    and a replicated weight, each key's raw tensor split over the 2 ranks mid-row as the engine's flat pieces)
    read through ``checkpoint_v1.TranslatedReader`` into full TP-global tensors: each shard where it belongs."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron.fsdp.checkpoint.pieces import sharded_piece
    from megatron.fsdp_training.checkpointing.layout_v1 import Rule, TranslatedReader

    rank, gen = dist.get_rank(), torch.Generator().manual_seed(5)
    experts, hidden, ffn, local_experts, local_ffn = 4, 3, 4, 2, 2
    w1, w2 = "decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"
    proj, norm = "decoder.layers.0.self_attention.linear_proj.weight", "decoder.final_layernorm.weight"
    raw = {}  # v1 key: the whole raw tensor of that TP (and EP) rank
    for t in range(2):
        for e in range(2):
            raw[f"tp{t}.ep{e}.{w1}"] = torch.randn(hidden, local_experts * 2 * local_ffn, generator=gen)  # GLU
            raw[f"tp{t}.ep{e}.{w2}"] = torch.randn(local_experts * local_ffn, hidden, generator=gen)
        raw[f"tp{t}.{proj}"] = torch.randn(hidden, 2, generator=gen)
        raw[f"tp{t}.{norm}"] = torch.full((hidden,), 1.0 + t)  # replicated: TP rank 0's copy is read
    pieces = {}
    for key, value in raw.items():
        cut = value.numel() // 2 + 1  # inside a row
        lo, hi = (0, cut) if rank == 0 else (cut, value.numel())
        pieces[key] = sharded_piece(value.reshape(-1)[lo:hi].clone(), value.shape, lo)
    dcp.save({"model": pieces}, checkpoint_id=directory)
    rules = {w1: Rule("grouped", 3, (experts, hidden, 2, ffn)), w2: Rule("grouped", 1, (experts, ffn, hidden)),
             proj: Rule("split", 1)}
    state = {"model": {w1: torch.zeros(experts, hidden, 2, ffn), w2: torch.zeros(experts, ffn, hidden),
                       proj: torch.zeros(hidden, 4), norm: torch.zeros(hidden)}}
    dcp.load(state, storage_reader=TranslatedReader(directory, rules))
    got, ok = state["model"], {}
    for t in range(2):
        f = slice(t * local_ffn, (t + 1) * local_ffn)
        for e in range(2):
            x = slice(e * local_experts, (e + 1) * local_experts)
            ok[f"w1 tp{t} ep{e}"] = torch.equal(got[w1][x, :, :, f],
                                                raw[f"tp{t}.ep{e}.{w1}"].view(local_experts, hidden, 2, local_ffn))
            ok[f"w2 tp{t} ep{e}"] = torch.equal(got[w2][x, f], raw[f"tp{t}.ep{e}.{w2}"].view(local_experts,
                                                                                            local_ffn, hidden))
        ok[f"proj tp{t}"] = torch.equal(got[proj][:, 2 * t:2 * t + 2], raw[f"tp{t}.{proj}"])
    ok["norm"] = torch.equal(got[norm], raw[f"tp0.{norm}"])
    return ok


# Pads to 512 rows at TP 1, 2 and 4 (NullTokenizer: 500 + end of document; a multiple of 128 x TP).
SAME_PADDING = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-load-balancing-type", "aux_loss", "--train-iters", "4", "--eval-interval", "4"]


def test_moe_checkpoint_loads_under_another_ep(tmp_path):
    """Saved at EP 2 (experts keyed by global index), loaded at EP 1 and EP 4: the same validation loss."""
    argv = MODEL + B8 + MOE + fsdp("optim_grads_params")
    saved = pretrain(4, argv + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                                 "--save", str(tmp_path)])
    keys = ckpt_inspect.describe(tmp_path / "iter_0000004")["keys"]
    assert {k.split("local_experts.")[1].split(".")[0] for k in keys if "local_experts." in k} == {"0", "1", "2", "3"}
    for ep in ("1", "4"):
        got = pretrain(4, argv + ["--expert-model-parallel-size", ep, "--moe-token-dispatcher-type", "allgather",
                                   "--load", str(tmp_path)])
        assert got["start_iteration"] == 4 and got["losses"] == []
        assert rel(got["valid_at_load"], saved["valid"][0]) <= 1e-5, (ep, got["valid_at_load"], saved["valid"])


@pytest.mark.mcore_only("HAS_LEGACY_GROUPED_MLP", why="Megatron-Core 0.17 removed GroupedMLP (--moe-grouped-gemm "
                        "builds SequentialMLP in the local spec)")
def test_moe_grouped_gemm_checkpoint_loads_at_another_tp_and_ep(tmp_path):
    """Grouped-GEMM experts (GroupedMLP: weight1/weight2 hold all local experts, gate/up per expert) saved at
    TP = expert TP 2 x EP 2, resumed at TP = expert TP 1 x EP 4: the validation loss at load and the steps
    after match the run that never stopped (a vocabulary that pads the same at TP 1 and 2: the 4.6% gap that once
    had such loads refused was the padding change, 512 -> 384 rows, not the expert weights)."""
    argv = (MODEL + B8 + SAME_PADDING + MOE + fsdp("optim_grads_params")
            + ["--moe-grouped-gemm", "--bf16", "--train-iters", "4", "--eval-interval", "2"])  # GroupedMLP: bf16 (emulated on some CPUs: few steps)
    saved = pretrain(4, argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather",
                                 "--save", str(tmp_path), "--save-interval", "2"])
    keys = ckpt_inspect.describe(tmp_path / "iter_0000002")["keys"]
    assert keys["model.decoder.layers.0.mlp.experts.weight1"]["shape"] == [4, 64, 256]
    assert keys["model.decoder.layers.0.mlp.experts.weight2"]["shape"] == [4, 256, 64]
    got = pretrain(4, argv + ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall",
                               "--load", str(tmp_path), "--ckpt-step", "2"])
    assert got["start_iteration"] == 2 and len(got["losses"]) == 2
    # GroupedMLP computes in bf16 only, which rounds differently at another TP: measured 3.4e-5 at most
    # (the same layout: equal; a misplaced expert or ffn block: percent). The fp32 weights loaded are the saved ones.
    assert rel(got["valid_at_load"], saved["valid"][0]) <= 1e-4, (got["valid_at_load"], saved["valid"])
    assert all(rel(a, b) <= 1e-4 for a, b in zip(got["losses"], saved["losses"][2:])), (got["losses"], saved["losses"])


V1_ARGS = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--num-layers", "1",
           "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--max-position-embeddings", "8",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--make-vocab-size-divisible-by", "8",
           "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3", "--eval-interval", "2",
           "--eval-iters", "1", "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "7", "--mock-data",
           "--tensor-model-parallel-size", "2", "--disable-bias-linear"]


def test_layout_v1_checkpoint_loads(tmp_path):
    """A checkpoint written by the previous layout (keys per TP rank; tests/data/README.md) loads at its TP size
    and at TP 1 (its TP-local pieces read in TP-global coordinates): the validation loss it logged, the next
    step's loss alike at both; saving again writes TP-global keys."""
    with tarfile.open(os.path.join(ROOT, "tests", "data", "checkpoint_v1_tp2.tar.xz")) as tar:
        tar.extractall(tmp_path, filter="data")
    old = tmp_path / "ckpt"
    assert any(k.startswith("model.tp1.") for k in ckpt_inspect.describe(old / "iter_0000002")["keys"])
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]  # the same step at both TP sizes
    got = pretrain(2, V1_ARGS + no_dropout + ["--load", str(old), "--save", str(tmp_path / "new")])
    assert got["start_iteration"] == 2 and len(got["losses"]) == 1
    assert rel(got["valid_at_load"], 4.166764) <= 1e-6, got["valid_at_load"]
    new = ckpt_inspect.describe(tmp_path / "new" / "iter_0000003")
    assert new["common"]["version"] == 2 and not any(".tp" in k for k in new["keys"])
    tp1 = V1_ARGS[:V1_ARGS.index("--tensor-model-parallel-size")] + V1_ARGS[V1_ARGS.index("--disable-bias-linear"):]
    at_tp1 = pretrain(2, tp1 + no_dropout + ["--load", str(old)])  # TP 1 x DP 2
    assert at_tp1["start_iteration"] == 2
    assert rel(at_tp1["valid_at_load"], got["valid_at_load"]) <= 1e-5, (at_tp1["valid_at_load"], got)
    assert rel(at_tp1["losses"][0], got["losses"][0]) <= 1e-5, (at_tp1["losses"], got["losses"])


def test_layout_v1_grouped_gemm_and_tp_pieces_read_tp_global(tmp_path):
    """Layout-1 pieces (grouped-GEMM weights per EP and expert-TP rank, raw shapes, split mid-row over DP; a
    TP-split and a replicated weight) land where the TP-global tensor has them: the EP / TP resharding of
    layout-1 checkpoints rests on this."""
    results = pool_of(2).run(layout_v1_translation, timeout=120, directory=str(tmp_path / "v1"))
    for ok in results:
        assert ok and all(ok.values()), ok


# ------------------------------------------------------------------------ keys
class _Chunk(torch.nn.Module):
    """The attributes of a GPTModel chunk that checkpoint keys read: layer numbers, expert indices, stage."""

    def __init__(self, layer_numbers, experts=None, pre=True, post=True, tied=True):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(torch.nn.Module() for _ in layer_numbers)
        for layer, number in zip(self.decoder.layers, layer_numbers):
            layer.layer_number = number
            layer.mlp = torch.nn.Module()
            if experts is not None:
                layer.mlp.local_expert_indices = experts
        self.pre_process, self.post_process, self.share_embeddings_and_output_weights = pre, post, tied


def test_global_keys():
    stage = _Chunk([3, 4], experts=[2, 3], pre=False)
    plain = ParallelRanks()
    assert global_key("decoder.layers.1.self_attention.linear_qkv.weight", stage, plain) == \
        "decoder.layers.3.self_attention.linear_qkv.weight"
    assert global_key("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", stage, plain) == \
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    assert global_key("output_layer.weight", stage, plain) == "embedding.word_embeddings.weight"
    assert global_key("output_layer.weight", _Chunk([1], tied=False, pre=False), plain) == "output_layer.weight"
    tp = ParallelRanks(tp=(1, 2), expert_tp=(0, 1), ep=(1, 2))
    assert global_key("decoder.final_layernorm.weight", stage, tp) == "decoder.final_layernorm.weight"
    assert global_key("decoder.layers.1.mlp.experts.weight1", stage, tp) == "decoder.layers.3.mlp.experts.weight1"
    # layout version 1: keys per TP rank (expert TP rank for experts), grouped GEMM per EP rank
    assert parse_v1_key("model.tp1.decoder.final_layernorm.weight") == ("model.", 1, None,
                                                                        "decoder.final_layernorm.weight")
    assert parse_v1_key("optimizer.state.tp0.ep1.decoder.layers.3.mlp.experts.weight1.exp_avg") == \
        ("optimizer.state.", 0, 1, "decoder.layers.3.mlp.experts.weight1.exp_avg")
    assert parse_v1_key("model.decoder.layers.0.mlp.linear_fc1.weight") is None
    keys = chunk_keys(stage, ["decoder.layers.0.x", "output_layer.weight"], plain)
    assert keys.localize(keys.globalize({"decoder.layers.0.x": 1})) == {"decoder.layers.0.x": 1}
    with pytest.raises(ValueError, match="same checkpoint keys"):
        chunk_keys(stage, ["output_layer.weight", "embedding.word_embeddings.weight"], plain)
    params = {"chunk1.decoder.layers.0.w": "decoder.layers.2.w"}
    assert rename_optimizer_key("state.chunk1.decoder.layers.0.w.exp_avg", params) == "state.decoder.layers.2.w.exp_avg"
    assert rename_optimizer_key("main.chunk1.decoder.layers.0.w", params) == "main.decoder.layers.2.w"
    assert rename_optimizer_key("param_groups.0.lr", params) == "param_groups.0.lr"


class _GroupedMLP(torch.nn.Module):
    """The attributes of Megatron-Core's GroupedMLP that its checkpoint coordinates read."""

    def __init__(self, experts_per_rank, hidden, ffn, glu, tp, num_experts):
        super().__init__()
        self.num_local_experts = experts_per_rank
        self.config = type("Config", (), dict(num_moe_experts=num_experts, moe_ffn_hidden_size=ffn,
                                              gated_linear_unit=glu))()
        f = ffn // tp
        self.weight1 = torch.nn.Parameter(torch.zeros(hidden, experts_per_rank * f * (2 if glu else 1)))
        self.weight2 = torch.nn.Parameter(torch.zeros(experts_per_rank * f, hidden))


def _placed(global_tensor, local, placement):
    return torch.equal(global_tensor[placement.region()], local.reshape(placement.view))


def test_tp_global_coordinates_match_megatron_shards():
    """Each kind of TP shard, split from a TP-1 tensor as Megatron-Core splits it, sits where its placement says."""
    f, h, tp = 6, 4, 2
    glu = torch.arange(2 * f * h, dtype=torch.float32).view(2 * f, h)  # [gate; up], as at TP 1
    row = torch.arange(h * 2 * f, dtype=torch.float32).view(h, 2 * f)
    for r in range(tp):
        gate, up = glu[:f].chunk(tp)[r], glu[f:].chunk(tp)[r]
        stored = glu.view(2, f, h)
        assert _placed(stored, torch.cat([gate, up]), split_placement((2 * f // tp, h), 0, 2, r, tp))
        assert _placed(row, row.chunk(tp, dim=1)[r], split_placement((h, f), 1, 1, r, tp))
        # QKV: each rank holds whole query groups, so Megatron's TP-1 order is the shards concatenated
        assert _placed(glu, glu.chunk(tp)[r], split_placement((f, h), 0, 1, r, tp))
    assert tp1_shape("decoder.layers.0.mlp.linear_fc1.weight", (2, f, h)) == (2 * f, h)
    assert tp1_shape("decoder.layers.0.mlp.linear_fc1.bias", (2, f)) == (2 * f,)
    assert tp1_shape("decoder.layers.0.mlp.linear_fc2.weight", (h, f)) == (h, f)
    # Vocabulary rows: a checkpoint of 10 padded rows into a TP 2 model of 16 (rows 10-15 outside it).
    assert split_placement((8, h), 0, 1, 1, 2, rows=10).region() == (slice(8, 10), slice(0, h))
    # Grouped GEMM, 4 experts, EP 2 x expert TP 2: rank (ep 1, tp 1) holds experts 2-3, ffn columns f/2..f.
    ranks = ParallelRanks(tp=(1, 2), expert_tp=(1, 2), ep=(1, 2))
    for with_glu in (True, False):
        module = torch.nn.Module()
        module.decoder = torch.nn.Module()
        module.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
        layer = module.decoder.layers[0]
        layer.layer_number, layer.mlp = 1, torch.nn.Module()
        layer.mlp.local_expert_indices = [2, 3]
        layer.mlp.experts = _GroupedMLP(2, h, f, with_glu, 2, 4)
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        placements = tp_placements(module, shapes, ranks)
        halves = (2,) if with_glu else ()
        full1 = torch.arange(4 * h * math.prod(halves) * f, dtype=torch.float32).view((4, h) + halves + (f,))
        local1 = full1[2:4, ..., f // 2:].contiguous()  # what rank (1, 1)'s forward views as [2, h, (2,) f/2]
        assert _placed(full1, local1, placements["decoder.layers.0.mlp.experts.weight1"])
        full2 = torch.arange(4 * f * h, dtype=torch.float32).view(4, f, h)
        assert _placed(full2, full2[2:4, f // 2:].contiguous(), placements["decoder.layers.0.mlp.experts.weight2"])
        assert tp1_shape("decoder.layers.0.mlp.experts.weight1", full1.shape) == (h, 4 * math.prod(halves) * f)
        assert tp1_shape("decoder.layers.0.mlp.experts.weight2", full2.shape) == (4 * f, h)
