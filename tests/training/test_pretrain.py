"""pretrain_gpt.py end to end: --use-megatron-fsdp at every level equals Megatron-Core DDP."""

import re

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp.testing.common import LEVELS
from megatron.fsdp.commands import PRETRAIN
from megatron.fsdp_training.testing.job import LINE
from megatron.fsdp_training.testing.job import PRETRAIN_MODEL as MODEL
from megatron.fsdp_training.testing.job import fsdp, torchrun
from megatron.fsdp_training.testing.pretrain import pretrain_in_pool
from tests.cases.level_matrix import full_matrix
from megatron.fsdp_training.testing.pools import pool_of


def _in_pool(ranks, extra):
    """``pretrain_gpt``'s training function in the Megatron pool of ``ranks`` (no new processes,
    no second import of Megatron-Core): per-iteration losses, grad norms and rank 0's log."""
    return pool_of(ranks).run(pretrain_in_pool, timeout=300,
                               argv=MODEL + extra, capture_log=True)[0]


def _close(rows, baseline, rtol=1e-5):
    for (i, loss, norm), (_, b_loss, b_norm) in zip(rows, baseline):
        assert abs(loss - b_loss) <= rtol * abs(b_loss), f"iteration {i}: lm loss {loss} vs {b_loss}"
        assert abs(norm - b_norm) <= rtol * abs(b_norm) + 1e-6, f"iteration {i}: grad norm {norm} vs {b_norm}"


def _rows(history):
    return [(i + 1, loss, norm) for i, (loss, norm) in enumerate(zip(history["losses"], history["grad_norms"]))]


@pytest.fixture(scope="module")
def baseline_2():
    """Megatron-Core DDP on 2 ranks, trained once in the pool."""
    return _rows(_in_pool(2, []))


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_pretrain_gpt_2_ranks_matches_megatron_ddp(baseline_2, level):
    run = _in_pool(2, fsdp(level))
    rows, stdout = _rows(run), run["log"]
    assert len(rows) == 6
    _close(rows, baseline_2)
    assert [int(i) for i, _, _ in LINE.findall(stdout)] == list(range(1, 7)), stdout[-2000:]
    assert "validation loss at iteration 3" in stdout and "peak memory (MiB) per rank" in stdout
    assert f"levels {level} (dp_shard) x no_shard (dp_outer)" in stdout
    assert rows[-1][1] < rows[0][1]  # the loss falls


def test_pretrain_gpt_torchrun_launch(baseline_2):
    """The README's command line: torchrun + pretrain_gpt.py --use-megatron-fsdp (ZeRO-3) prints the same
    losses and grad norms (to the log's precision) as Megatron-Core DDP trained in the pool. The one
    launch of the module: the other levels run in the pool, where Megatron-Core is imported once."""
    rows, stdout = torchrun(2, MODEL + fsdp("optim_grads_params"))
    _close(rows, baseline_2)
    assert "levels optim_grads_params (dp_shard) x no_shard (dp_outer)" in stdout


META = ["--init-model-with-meta-device"]


def _same_history(got, want, what):
    """Bitwise: a meta-device build must train exactly as the eager build of the same --seed."""
    for key in ("losses", "grad_norms", "valid"):
        assert len(got[key]) == len(want[key]) > 0 and got[key] == want[key], (what, key, got[key], want[key])


@pytest.mark.slow
def test_pretrain_gpt_tp2_dp2_all_levels(mcore_pool):
    """TP 2 + SP x DP 2 against Megatron DDP at ZeRO-1 and ZeRO-3 (one level that keeps full gradients,
    one that shards everything); no_shard and ZeRO-2 meet TP 2 in tests/mcore/test_adapter.py's parity
    table and in test_checkpoint_resume's TP 2 resume, and every level runs through pretrain above.
    ZeRO-3 built on the meta device equals its eager build, bitwise."""
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    base = mcore_pool.run(pretrain_in_pool, timeout=300, argv=MODEL + tp)[0]
    runs = {}
    for level in LEVELS if full_matrix() else ["optim", "optim_grads_params"]:
        got = runs[level] = mcore_pool.run(pretrain_in_pool, timeout=300,
                                           argv=MODEL + tp + fsdp(level))[0]
        for key in ("losses", "grad_norms", "valid"):
            for a, b in zip(got[key], base[key]):
                assert abs(a - b) <= 1e-5 * abs(b), (level, key, got[key], base[key])
    meta = mcore_pool.run(pretrain_in_pool, timeout=300,
                          argv=MODEL + tp + fsdp("optim_grads_params") + META)[0]
    _same_history(meta, runs["optim_grads_params"], "tp2 meta")


PP2 = ["--pipeline-model-parallel-size", "2"]  # MODEL ties the embedding to the output layer (the default)


@pytest.mark.parametrize("what, parallel", [
    ("dp4-zero3", fsdp("optim_grads_params")),
    ("pp2-dp2-optim_grads", fsdp("optim_grads") + PP2),
])
def test_pretrain_gpt_meta_device_init_equals_eager(mcore_pool, what, parallel):
    """--init-model-with-meta-device: the same losses, bitwise, as the eager build (PP 2: tied embedding
    synchronised over the embedding group after materialisation, as Megatron-Core does at construction).
    PP 2's eager build trains as Megatron-Core's DDP does: the tied embedding's gradients summed across the stages."""
    eager = mcore_pool.run(pretrain_in_pool, timeout=300, argv=MODEL + parallel)[0]
    meta = mcore_pool.run(pretrain_in_pool, timeout=300,
                          argv=MODEL + parallel + META)[0]
    _same_history(meta, eager, what)
    if what.startswith("pp2"):
        base = mcore_pool.run(pretrain_in_pool, timeout=300, argv=MODEL + PP2)[0]
        for key in ("losses", "grad_norms", "valid"):
            assert len(eager[key]) == len(base[key]) > 0, (key, eager[key], base[key])
            for a, b in zip(eager[key], base[key]):
                assert abs(a - b) <= 1e-5 * abs(b), (key, eager[key], base[key])


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-load-balancing-type", "aux_loss"]


@pytest.mark.parametrize("dispatcher, ep, expert_level", [("alltoall", 2, "optim"), ("allgather", 4, None)])
def test_pretrain_gpt_moe_4_ranks_matches_megatron_ddp(mcore_pool, dispatcher, ep, expert_level):
    """pretrain_gpt.py --num-experts 4 on 4 CPU ranks: dense ZeRO-3, experts at their own level."""
    moe = MOE + ["--moe-token-dispatcher-type", dispatcher, "--expert-model-parallel-size", str(ep),
                 "--train-iters", "4", "--eval-interval", "2"]  # the suite's budget: 4 iterations show the updates
    levels = fsdp("optim_grads_params") + (
        ["--expert-data-parallel-sharding-strategy", expert_level] if expert_level else [])
    base = mcore_pool.run(pretrain_in_pool, timeout=300, argv=MODEL + moe)[0]
    got = mcore_pool.run(pretrain_in_pool, timeout=300, capture_log=True, argv=MODEL + moe + levels)[0]
    # The router's load-balancing loss is logged as Megatron-LM logs it, the same as the baseline's.
    assert len(got["load_balancing_loss"]) == len(got["losses"]) and "load_balancing_loss: " in got["log"]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got["load_balancing_loss"], base["load_balancing_loss"]))
    assert f"experts (EP {ep}, expert DP {4 // ep}): levels {expert_level or 'optim_grads_params'}" in got["log"]
    for key in ("losses", "grad_norms", "valid"):
        assert len(got[key]) == len(base[key]) > 0
        for a, b in zip(got[key], base[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], base[key])
    if ep == 2:  # experts built on the meta device too: the same run, bitwise
        meta = mcore_pool.run(pretrain_in_pool, timeout=300, argv=MODEL + moe + levels + META)[0]
        _same_history(meta, got, "moe ep2 meta")


@pytest.mark.parametrize("argv, world, pattern", [
    (["--mock-data", "--global-batch-size", "6", "--micro-batch-size", "4"], 1, "not a multiple of --micro-batch-size"),
    (["--mock-data", "--tensor-model-parallel-size", "3"], 4, "does not divide the 4 ranks"),
    (["--mock-data", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "zero3"], 2, "valid strategies"),
    (["--mock-data", "--data-parallel-sharding-strategy", "optim"], 2, "need --use-megatron-fsdp"),
    (["--mock-data", "--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"], 4, "outer"),
    (["--mock-data", "--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "not divisible by --pipeline"),
    (["--mock-data", "--num-attention-heads", "3"], 1, "not divisible by --num-attention-heads"),
    ([], 1, "no data: pass --mock-data"),
    (["--data-path", "x"], 1, "needs --tokenizer-type"),
    (["--mock-data", "--fp16"], 1, "use --bf16"),
    (["--mock-data", "--context-parallel-size", "2", "--seq-length", "30"], 2, "divisible by 2 x --context"),
    (["--mock-data", "--num-experts", "4"], 2, "needs --disable-bias-linear"),
    (["--mock-data", "--num-experts", "3", "--disable-bias-linear", "--expert-model-parallel-size", "2"], 2,
     "not divisible by --expert-model-parallel-size"),
    (["--mock-data", "--expert-model-parallel-size", "2"], 2, "needs --num-experts"),
    (["--mock-data", "--init-model-with-meta-device"], 2, "--init-model-with-meta-device needs --use-megatron-fsdp"),
    (["--mock-data", "--num-experts", "4", "--disable-bias-linear", "--expert-model-parallel-size", "4"], 2,
     "does not divide the 2 ranks"),
    (["--mock-data", "--num-experts", "4", "--disable-bias-linear", "--use-megatron-fsdp",
      "--expert-data-parallel-sharding-strategy", "zero1"], 2, "valid strategies"),
    (["--mock-data", "--num-experts", "4", "--disable-bias-linear", "--use-megatron-fsdp",
      "--expert-num-distributed-optimizer-instances", "3"], 4, "do not divide the expert data-parallel size"),
    (["--mock-data", "--num-experts", "4", "--disable-bias-linear", "--expert-data-parallel-sharding-strategy",
      "optim"], 2, "need --use-megatron-fsdp"),
])
def test_startup_errors(argv, world, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(argv), world)


def test_startup_error_from_the_command_line(capsys):
    """pretrain_gpt.py's entry point (``training.main``, what the script calls): the message on stdout, exit
    status 2, before any process group exists (run in this process: no second Megatron-Core import)."""
    from megatron.fsdp_training.training import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--mock-data", "--global-batch-size", "6", "--micro-batch-size", "4"])
    assert exit_info.value.code == 2
    assert "error: --global-batch-size 6 is not a multiple of --micro-batch-size 4" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["--use-torch-fsdp2"], r"^error: --use-torch-fsdp2 is not built in this job \(.*--use-megatron-fsdp"),
    (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"],
     r"^error: --optimizer-cpu-offload, --optimizer-offload-fraction are not built in this job \(.*host"),
    (["--no-such-flag"], rf"^error: unrecognized arguments: --no-such-flag \({PRETRAIN} --help"),
    (["--num-layers", "four"], r"^error: argument --num-layers: invalid int value: 'four' \(.*--help"),
])
def test_parse_error_is_one_line(capsys, argv, expected):
    """A flag the parser does not take is one line and exit status 2, not argparse's 170-line usage; a
    Megatron-LM flag of a feature this job does not build says why and what to use instead."""
    from megatron.fsdp_training.training import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1 and re.search(expected, lines[0]), captured.out
    assert "usage:" not in captured.out + captured.err
def test_help_shows_every_default():
    from megatron.fsdp_training.arguments import build_parser

    parser = build_parser()
    text = " ".join(parser.format_help().split())
    assert "plain data parallel like DDP" in text and "(default: no_shard)" in text
    for action in parser._actions:  # every argument says its default (argparse prints none without a help text)
        if action.option_strings and action.dest != "help":
            assert "default" in parser._get_formatter()._get_help_string(action), action.option_strings
