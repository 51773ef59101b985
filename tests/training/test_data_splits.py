"""Real data with a small corpus: only the used splits are built, an empty one stops the job at start-up.

Megatron-Core loops forever on a split with no documents; every case here runs
under an alarm so that a regression fails in seconds instead of hanging the suite.
"""

import contextlib
import signal

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.testing.pretrain import pretrain_in_pool
from tests.cases.corpus import SMALL, corpus


@contextlib.contextmanager
def _no_hang(seconds: int = 60):
    def _raise(*_):
        raise TimeoutError(f"no answer within {seconds} s: a split with no documents loops forever")
    previous = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    return {n: corpus(d, n) for n in (10, 40)}


def test_small_corpus_errors_name_the_split_and_a_working_split(corpora, capsys):
    from megatron.fsdp_training.training import main

    # 10 documents at the default 969,30,1: validation rounds to 0 documents.
    argv = SMALL + ["--data-path", corpora[10]]
    with _no_hang(), pytest.raises(ArgumentError) as error:
        validate_args(parse_args(argv), 1)
    message = str(error.value)
    assert "validation split" in message and "0 documents (of its 10)" in message
    assert "--split 9,1,0" in message and "\n" not in message
    validate_args(parse_args(argv + ["--split", "9,1,0"]), 1)  # the suggested split works
    validate_args(parse_args(argv + ["--eval-iters", "0"]), 1)  # and so does no validation
    with pytest.raises(ArgumentError, match=r"train split .* 0 documents"):
        validate_args(parse_args(argv + ["--split", "0,1,0"]), 1)
    with pytest.raises(ArgumentError, match=r"no file .*nowhere\.idx"):
        validate_args(parse_args(SMALL + ["--data-path", corpora[10][:-5] + "nowhere"]), 1)
    # From the command line: one line, rank 0 only, exit status 2, before any process group.
    with _no_hang(), pytest.raises(SystemExit) as exit_status:
        main(argv)
    assert exit_status.value.code == 2
    assert capsys.readouterr().out.strip().splitlines() == [f"error: {message}"]


def test_default_split_builds_only_used_splits(corpora):
    """40 documents at 969,30,1: the test split has none; it is unused, so it is not built (no hang)."""
    from megatron.fsdp_training.data import datasets as data
    from megatron.fsdp_training.data.data_config import DataConfig

    args = validate_args(parse_args(SMALL + ["--data-path", corpora[40]]), 1)
    with _no_hang():
        config = DataConfig.from_args(args)
        train, valid, test = data.build_datasets(config, data.build_tokenizer(config.tokenizer))
    assert test is None and len(train) >= args.train_iters * args.global_batch_size and len(valid) >= 1
    args = validate_args(parse_args(SMALL + ["--data-path", corpora[40], "--eval-iters", "0"]), 1)
    with _no_hang():
        config = DataConfig.from_args(args)
        assert data.build_datasets(config, data.build_tokenizer(config.tokenizer))[1:] == [None, None]


def test_small_corpus_default_split_trains_on_4_ranks(mcore_pool, corpora):
    """Trains at the default split; the log: persistent bytes after step 1, peak memory per interval, summary."""
    argv = SMALL + ["--data-path", corpora[40], "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                    "optim_grads_params", "--num-distributed-optimizer-instances", "2", "--eval-interval", "2",
                    "--eval-iters", "1", "--train-iters", "4", "--log-interval", "2"]
    got = mcore_pool.run(pretrain_in_pool, timeout=120, argv=argv, capture_log=True)[0]
    assert len(got["losses"]) == 4 and len(got["valid"]) == 2
    lines = got["log"].splitlines()
    assert "mesh dp_shard 2 x dp_outer 2" in got["log"]  # HSDP: the mesh sizes
    persistent = next(i for i, line in enumerate(lines) if "persistent bytes per rank" in line)
    assert "optimizer state" in lines[persistent] and len(lines[persistent].split(":")[1].split()) == 4
    logged = [i for i, line in enumerate(lines) if line.startswith(" iteration ")]
    assert len(logged) == 2 and persistent < logged[0]  # printed after step 1, before the first log line
    assert all(lines[i + 1].startswith(" peak memory (MiB) per rank:") for i in logged)  # every interval
    mean = sum(got["losses"][:2]) / 2  # lm loss averaged over the interval, as Megatron-LM does
    assert f"lm loss: {mean:.6E}" in lines[logged[0]]
    done = [line for line in lines if line.startswith(" training done |")]
    assert len(done) == 1 and "iterations: 4 |" in done[0] and "tokens per second:" in done[0]
    assert f"max over ranks and iterations: {got['max_peak_mib']:.0f} |" in done[0]
