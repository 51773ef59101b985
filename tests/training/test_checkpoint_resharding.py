"""Checkpoints of pretrain_gpt.py loaded at another layout or through the checkpoint tools: a DP 4 ZeRO-3
checkpoint at other DP sizes, levels, HSDP and PP; a TP 2 x DP 2 one at other TP and PP sizes; vocabulary padding
rows cut and added; PP x VPP to DP and back; every load error, raised with the model unchanged; inspect and the
conversion to and from a torch file (an unsharded GPTModel: equal weights and logits).

Megatron cases run in gloo pools of the size they need (each case uses its whole pool:
``initialize_model_parallel`` spans the world). The two saved runs are module fixtures that several tests load.
"""

from typing import Dict, List

import pytest
import torch

from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.checkpointing import files
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp_training.testing.megatron_case import megatron_case
from megatron.fsdp_training.testing.pools import pool_of
from megatron.fsdp_training.tools.checkpoint_tools import convert
from megatron.fsdp_training.tools.checkpoint_tools import inspect as ckpt_inspect
from tests.cases.job_runs import B8, B12, MODEL, causal_inputs, load_error, pretrain


def _compute_matches_main(chunk) -> bool:
    """Compute weights equal the main weights cast to the compute dtype wherever this rank holds both."""
    ok = True
    for unit in chunk.fsdp.units:
        s = unit.storage
        a, b = s.regions.main
        if a < b:
            ok &= torch.equal(s.compute_slice(a, b), s.main.to(s.compute_dtype))
    return bool(ok)


@torch.no_grad()
def loaded_vs_unsharded(ctx, argv: List[str], model_file: str) -> Dict[str, object]:
    """Logits of the sharded model after ``--load`` against an unsharded GPTModel loaded from ``model_file``.

    Also: compute weights equal the loaded main weights before the first forward,
    and the unsharded model's weights equal the sharded model's full weights.
    """
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    with megatron_case():
        device, _, model, optimizer, scheduler = setup(args)
        iteration, _ = checkpointing.load_checkpoint(CheckpointConfig.from_args(args), model, optimizer, scheduler)
        compute_ok = all(_compute_matches_main(chunk) for chunk in model)
        tokens, positions, mask = causal_inputs(args.padded_vocab_size, args.seq_length)
        model[0].eval()
        sharded = model[0](tokens, positions, mask)
        full = model[0].full_state_dict()
        config = model_lib.transformer_config(args, device.type == "cpu")
        build = model_lib.ModelBuildConfig.from_args(args, device.type == "cpu")
        plain = model_lib.build_model_chunks(config, build, args.padded_vocab_size)[0]
        result = plain.load_state_dict(torch.load(model_file, weights_only=False), strict=False)
        plain.eval()
        unsharded = plain(tokens, positions, mask)
        plain_sd = plain.state_dict()
        return {"iteration": iteration, "compute_matches_main": compute_ok,
                "missing": [k for k in result.missing_keys if not k.endswith("_extra_state")],
                "unexpected": list(result.unexpected_keys),
                "weights_equal": all(torch.equal(plain_sd[k], v) for k, v in full.items()),
                "max_logit_diff": float((sharded - unsharded).abs().max())}


def fresh_then_loaded(ctx, argv: List[str], fresh, loaded: str) -> None:
    """Save the freshly built model of ``argv`` (iteration 0) to ``fresh`` (unless None), load ``--load``,
    save it to ``loaded``."""
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        for directory in [d for d in (fresh, loaded) if d]:
            args.save = directory
            checkpoint = CheckpointConfig.from_args(args)
            if directory == loaded:
                iteration, consumed = checkpointing.load_checkpoint(checkpoint, model, optimizer, scheduler)
            else:
                iteration, consumed = 0, 0
            checkpointing.save_checkpoint(checkpoint, iteration, consumed, model, optimizer, scheduler)


# ------------------------------------------------------------------- resharding
@pytest.fixture(scope="module")
def dp4_zero3(tmp_path_factory):
    """DP 4 ZeRO-3, 10 iterations, saved at 5 and 10: the run that never stopped."""
    directory = tmp_path_factory.mktemp("dp4_zero3")
    history = pretrain(4, MODEL + B12 + fsdp("optim_grads_params") + ["--save", str(directory),
                                                                         "--save-interval", "5"])
    return directory, history


RESHARD = {
    "dp2-zero1": (2, fsdp("optim")),
    "dp4-hsdp-2x2": (4, fsdp("optim_grads_params") + ["--num-distributed-optimizer-instances", "2",
                                                         "--outer-dp-sharding-strategy", "no_shard"]),
    "dp1-no_shard": (1, fsdp("no_shard")),
    "dp3-zero2": (3, fsdp("optim_grads")),
    "pp2-dp2-zero3": (4, fsdp("optim_grads_params") + ["--pipeline-model-parallel-size", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", list(RESHARD))
def test_reshard_dp4_zero3_checkpoint(dp4_zero3, target):
    """Loaded elsewhere: the validation loss before any step and the steps after match the run that never stopped."""
    directory, saved = dp4_zero3
    ranks, layout = RESHARD[target]
    got = pretrain(ranks, MODEL + B12 + layout + ["--load", str(directory), "--ckpt-step", "5"])
    assert got["start_iteration"] == 5
    assert rel(got["valid_at_load"], saved["valid"][0]) <= 1e-5, (got["valid_at_load"], saved["valid"][0])
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == 5
        for a, b in zip(got[key], saved[key][5:]):
            assert rel(a, b) <= 1e-5, (key, got[key], saved[key][5:])


# Pads to 512 rows at TP 1, 2 and 4 (NullTokenizer: 500 + end of document; a multiple of 128 x TP).
SAME_PADDING = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
TP_SOURCE = MODEL + B8 + SAME_PADDING + fsdp("optim_grads_params")


@pytest.fixture(scope="module")
def tp2_dp2_zero3(tmp_path_factory):
    """TP 2 x DP 2 ZeRO-3 with sequence parallel, 10 iterations, saved at 5 and 10: the run that never stopped."""
    directory = tmp_path_factory.mktemp("tp2_dp2")
    history = pretrain(4, TP_SOURCE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                        "--save", str(directory), "--save-interval", "5"])
    return directory, history


TP_RESHARD = {
    "tp1-dp4-zero2": fsdp("optim_grads"),
    "tp4-dp1-sp": ["--tensor-model-parallel-size", "4", "--sequence-parallel"],
    "tp2-pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
}


@pytest.mark.parametrize("target", list(TP_RESHARD))
def test_tp_reshard(tp2_dp2_zero3, target):
    """A TP 2 x DP 2 checkpoint (TP-global keys) at TP 1 x DP 4, TP 4 x DP 1 and TP 2 x PP 2: the validation
    loss at load and the five steps after match the run that never stopped."""
    directory, saved = tp2_dp2_zero3
    got = pretrain(4, TP_SOURCE + TP_RESHARD[target] + ["--load", str(directory), "--ckpt-step", "5"])
    assert got["start_iteration"] == 5
    assert rel(got["valid_at_load"], saved["valid"][0]) <= 1e-5, (got["valid_at_load"], saved["valid"][0])
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == 5
        assert all(rel(a, b) <= 1e-5 for a, b in zip(got[key], saved[key][5:])), (key, got[key], saved[key][5:])


def test_inspect_and_convert_a_tp2_checkpoint(tp2_dp2_zero3, tmp_path, capsys):
    """inspect names the layout it was written at and that any loads it; to-torch --model-only of a TP 2
    checkpoint is a single-rank GPTModel's state dict: equal weights and logits to the TP 1 model loading it."""
    directory, _ = tp2_dp2_zero3
    ckpt_inspect.main([str(directory), "--iteration", "5"])
    out = capsys.readouterr().out
    assert "written at: world 4 = TP 2 x PP 1 x CP 1 x DP 2" in out and "loads at: any TP, PP, EP" in out
    model_file = tmp_path / "model.pt"
    convert.to_torch(str(directory), str(model_file), model_only=True, iteration=5)
    result = pool_of(4).run(loaded_vs_unsharded, timeout=300,
                             argv=TP_SOURCE + ["--load", str(directory), "--ckpt-step", "5"],
                             model_file=str(model_file))
    for r in result:
        assert r["iteration"] == 5 and r["compute_matches_main"] and r["weights_equal"], r
        assert r["missing"] == [] and r["unexpected"] == [] and r["max_logit_diff"] <= 1e-5, r


def test_vocabulary_padding_rows_cut_and_added(tmp_path):
    """ByteLevel vocabulary: 512 padded rows at TP 2, 384 at TP 1. TP 2 -> TP 1 cuts rows 384-511; TP 1 -> TP 2
    adds them with the values (and zero optimizer state) a fresh TP 2 model has; real rows never change."""
    argv = MODEL + B8 + fsdp("optim_grads_params") + ["--train-iters", "2", "--eval-interval", "2",
                                                       "--lr-warmup-iters", "1"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    pretrain(4, argv + tp2 + ["--save", str(tmp_path / "tp2")])
    for source, layout, out, fresh in (("tp2", [], "tp1", None), ("tp1", tp2, "back", "back_fresh")):
        pool_of(4).run(fresh_then_loaded, timeout=300,
                        argv=argv + layout + ["--load", str(tmp_path / source)],
                        fresh=fresh and str(tmp_path / fresh), loaded=str(tmp_path / out))
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    read = {name: convert.read_checkpoint(files.checkpoint_dir(tmp_path / name, it))
            for name, it in (("tp2", 2), ("tp1", 2), ("back", 2), ("back_fresh", 0))}
    table = {name: state["model"]["embedding.word_embeddings.weight"] for name, state in read.items()}
    assert [t.shape[0] for t in table.values()] == [512, 384, 512, 512]
    assert torch.equal(table["tp1"], table["tp2"][:384]) and torch.equal(table["back"][:384], table["tp2"][:384])
    assert torch.equal(table["back"][384:], table["back_fresh"][384:])
    moment = read["back"]["optimizer"]["state.embedding.word_embeddings.weight.exp_avg"]
    assert moment[384:].abs().sum() == 0 and moment[:256].abs().sum() > 0
    assert torch.equal(read["back"]["model"][fc1], read["tp2"]["model"][fc1])  # everything else unchanged


@pytest.mark.slow
def test_virtual_pipeline_checkpoint_loads_without_pipeline(tmp_path):
    """PP 2 x VPP 2 (four chunks' layers under global numbers, tied output on the last stage) -> DP 4 and back."""
    argv = MODEL + B8 + fsdp("optim_grads_params") + ["--num-layers", "4", "--train-iters", "4",
                                                       "--eval-interval", "2"]
    vpp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    saved = pretrain(4, argv + vpp + ["--save", str(tmp_path), "--save-interval", "2"])
    flat = pretrain(4, argv + ["--load", str(tmp_path), "--ckpt-step", "2"])
    again = pretrain(4, argv + vpp + ["--load", str(tmp_path), "--ckpt-step", "2"])
    for got in (flat, again):
        assert rel(got["valid_at_load"], saved["valid"][0]) <= 1e-5
        assert all(rel(a, b) <= 1e-5 for a, b in zip(got["losses"], saved["losses"][2:]))
    assert again["losses"] == saved["losses"][2:]


# ------------------------------------------------------------------ load errors
def _crafted(source, target):
    """A copy of ``source`` with a key removed, one added and one shape changed (via the torch file format)."""
    state = convert.read_checkpoint(source)
    state["common"] = files.read_common(source)
    del state["model"]["decoder.layers.1.mlp.linear_fc2.bias"]
    state["model"]["decoder.layers.7.mlp.extra.weight"] = torch.zeros(3)
    state["optimizer"]["state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg"] = torch.zeros(3, 3)
    torch.save(state, target.parent / "crafted.pt")
    return convert.from_torch(str(target.parent / "crafted.pt"), str(target))


def test_load_errors_name_the_problem_and_change_nothing(dp4_zero3, tmp_path):
    directory, _ = dp4_zero3
    crafted = _crafted(directory / "iter_0000005", tmp_path / "crafted")
    cases = [
        (["--hidden-size", "128", "--ffn-hidden-size", "512", "--load", str(directory)],
         ["--hidden-size 64 in the checkpoint, 128 now", "--ffn-hidden-size 256 in the checkpoint, 512 now"]),
        (["--num-attention-heads", "8", "--load", str(directory)],
         ["--num-attention-heads 4 in the checkpoint, 8 now"]),
        (["--load", str(crafted.parent)],
         ["missing keys: model.decoder.layers.1.mlp.linear_fc2.bias",
          "unexpected keys: model.decoder.layers.7.mlp.extra.weight",
          "mismatched keys: optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg (checkpoint (3, 3)"]),
    ]
    for extra, fragments in cases:
        result = pool_of(4).run(load_error, timeout=300,
                                 argv=MODEL + B12 + fsdp("optim_grads_params") + extra)
        assert len({r["error"] for r in result}) == 1  # every rank raises the same error
        error = result[0]["error"]
        assert error is not None and all(f in error for f in fragments), error
        assert all(r["unchanged"] for r in result)


# ------------------------------------------------------------------- conversion
def test_convert_round_trip(dp4_zero3, tmp_path, capsys):
    """DCP -> torch file -> DCP: the unsharded model gets the same weights and outputs; pretrain resumes from it."""
    directory, saved = dp4_zero3
    model_file, full_file, back = tmp_path / "model.pt", tmp_path / "full.pt", tmp_path / "back"
    convert.to_torch(str(directory), str(model_file), model_only=True, iteration=5)
    convert.to_torch(str(directory), str(full_file), iteration=5)
    convert.from_torch(str(full_file), str(back))
    original, copy = (ckpt_inspect.describe(d)["keys"] for d in (directory / "iter_0000005", back / "iter_0000005"))
    assert {k: v.get("shape") for k, v in original.items()} == {k: v.get("shape") for k, v in copy.items()}
    ckpt_inspect.main([str(back)])
    assert "iteration 5, consumed samples 60, saved on 4 ranks" in capsys.readouterr().out
    result = pool_of(4).run(loaded_vs_unsharded, timeout=300,
                             argv=MODEL + B12 + fsdp("optim") + ["--load", str(back)], model_file=str(model_file))
    for r in result:
        assert r["iteration"] == 5 and r["compute_matches_main"] and r["weights_equal"], r
        assert r["missing"] == [] and r["unexpected"] == [] and r["max_logit_diff"] <= 1e-5, r
    got = pretrain(4, MODEL + B12 + fsdp("optim_grads") + ["--load", str(back)])
    assert rel(got["valid_at_load"], saved["valid"][0]) <= 1e-6
    assert all(rel(a, b) <= 1e-5 for a, b in zip(got["losses"], saved["losses"][5:]))
