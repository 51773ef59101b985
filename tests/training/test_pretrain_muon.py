"""pretrain_gpt --optimizer muon: every level equals no_shard on the same topology; TP blockwise and duplicated.

Sampled (the suite budget): DP 4 at optim_grads_params, TP 2 x DP 2 blockwise at
optim and duplicated at optim_grads_params, each against no_shard on its
topology for 6 iterations (the engine tests cover every level).
Measured differences: see RTOL. ``--muon-extra-scale-factor 0.2``
(spectral x 0.2: Moonlight's AdamW-RMS match, torch's ``match_rms_adamw``).
"""

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.testing.job import PRETRAIN_MODEL as MODEL
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp_training.testing.pretrain import pretrain_in_pool
from tests.cases.job_runs import assert_exact_resume


MUON = ["--optimizer", "muon", "--muon-use-nesterov", "--muon-extra-scale-factor", "0.2"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# Losses within 1e-5 as asked; grad norms within 1e-4: the levels reduce gradients in different
# orders (fp32, ~1e-7), bf16(U) then rounds a few elements the other way, and Newton-Schulz carries
# that into the weights. Measured over these 6 iterations with Megatron-LM's defaults (quintic
# coefficients, momentum 0.9; `python -m pytest tests/training/test_pretrain_muon.py`): losses within
# 4e-7, grad norms within 2.3e-6 (DP 4 ZeRO-3), 6.3e-6 (TP 2 blockwise), 7.9e-6 (TP 2 duplicated).
RTOL = {"losses": 1e-5, "valid": 1e-5, "grad_norms": 1e-4}


def _pretrain(pool, argv, capture_log=False):
    return pool.run(pretrain_in_pool, timeout=300, argv=MODEL + MUON + argv, capture_log=capture_log)[0]


def _close(got, base, what):
    for key in ("losses", "grad_norms", "valid"):
        assert len(got[key]) == len(base[key]) > 0
        for a, b in zip(got[key], base[key]):
            assert abs(a - b) <= RTOL[key] * abs(b), (what, key, got[key], base[key])


def test_pretrain_muon_dp4_zero3_matches_no_shard(mcore_pool):
    base = _pretrain(mcore_pool, fsdp("no_shard"), capture_log=True)
    assert base["losses"][-1] < base["losses"][0]
    # the log says Muon is on, with its settings
    assert "> optimizer: Muon on the 2-D weight matrices (momentum 0.9, Nesterov on, 5 Newton-Schulz steps " \
           "(quintic coefficients), scale spectral x 0.2, TP mode blockwise); Adam on the embedding" in base["log"], \
        base["log"][:3000]
    _close(_pretrain(mcore_pool, fsdp("optim_grads_params")), base, "dp4 optim_grads_params")


def test_pretrain_muon_tp2_blockwise_and_duplicated_match_no_shard(mcore_pool):
    block = _pretrain(mcore_pool, TP2 + fsdp("no_shard"))  # blockwise is Megatron's default
    _close(_pretrain(mcore_pool, TP2 + fsdp("optim")), block, "tp2 blockwise optim")
    dup = ["--muon-tp-mode", "duplicated"]
    whole = _pretrain(mcore_pool, TP2 + dup + fsdp("no_shard"))
    _close(_pretrain(mcore_pool, TP2 + dup + fsdp("optim_grads_params")), whole, "tp2 duplicated ZeRO-3")
    # duplicated orthogonalises the whole matrix, blockwise each TP shard alone: same first two
    # losses (the first update shows from the third), different after
    assert whole["losses"][:2] == block["losses"][:2] and whole["losses"][2:] != block["losses"][2:]


@pytest.mark.parametrize("argv, pattern", [
    (["--optimizer", "muon", "--bf16", "--fp16", "--use-megatron-fsdp"], "muon with --fp16 is not supported"),
    (["--optimizer", "muon"], "needs --use-megatron-fsdp.*emerging_optimizers"),
    (["--optimizer", "muon", "--use-megatron-fsdp", "--muon-num-ns-steps", "0"], "at least 1"),
])
def test_muon_startup_errors(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


def test_pretrain_muon_exact_resume_zero3(mcore_pool, tmp_path):
    """--optimizer muon at DP 4 ZeRO-3, 6 iterations saving at 3 (fsdp_dtensor, Muon momentum and
    AdamW state in the DCP optimizer state) against a fresh run loading iteration 3: bitwise."""

    argv = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "6",
            "--eval-interval", "3"] + fsdp("optim_grads_params")  # 6 iterations: the suite's budget
    straight = _pretrain(mcore_pool, argv + ["--save", str(tmp_path), "--save-interval", "3"])
    resumed = _pretrain(mcore_pool, argv + ["--load", str(tmp_path), "--ckpt-step", "3"])
    assert_exact_resume(straight, resumed, 3)
