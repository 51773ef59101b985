"""What a user steers by: throughput (against a hand count), TensorBoard and offline wandb scalars
(read back, equal to the log lines), timers, the writers' start-up checks, and a Hugging Face
BPE tokenizer trained here from local text, through the preprocessing tool into a training run."""

import glob
import json
import math
import re
import struct
import sys
import sysconfig
from pathlib import Path

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.logs.model_size import ModelSize
from megatron.fsdp_training.logs.throughput import num_floating_point_operations, throughput
from megatron.fsdp_training.testing.pretrain import pretrain_in_pool
from tools.train_hf_tokenizer import train_tokenizer


SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def _args(extra, world=4, vocab=384):
    args = validate_args(parse_args(["--mock-data"] + SHAPE + extra), world)
    args.padded_vocab_size = vocab
    return args


# ------------------------------------------------------------------- throughput
def _hand_flops(b, s, h, layers, q, kv, ffn_gemms, vocab):
    """Forward GEMM FLOPs (2 m n k each) per token, counted matrix by matrix, x3 for the backward pass."""
    attention = 2 * h * (q + 2 * kv) + 2 * s * q / 2 + 2 * s * q / 2 + 2 * q * h  # qkv, causal QK^T and PV, proj
    mlp = sum(2 * h * f for f in ffn_gemms)
    return 3 * b * s * (layers * attention + mlp + 2 * h * vocab)


def test_throughput_against_a_hand_count():
    """Dense Llama shape: 4 heads of 16 channels, 2 KV groups, SwiGLU 128 (three 64x128 matrices per layer)."""
    args = _args([])
    f = args.ffn_hidden_size
    assert f == 128
    hand = _hand_flops(8, 32, 64, 2, q=64, kv=32, ffn_gemms=[f, f, f] * 2, vocab=384)
    assert num_floating_point_operations(ModelSize.from_args(args), 8) == pytest.approx(hand, rel=1e-12)
    rates = throughput(ModelSize.from_args(args), elapsed_seconds=0.5, world_size=4, batch=args.global_batch_size)
    assert rates.tflops_per_gpu == pytest.approx(hand / 0.5 / 4 / 1e12, rel=1e-12)
    assert rates.tokens_per_second_per_rank == 8 * 32 / 0.5 / 4
    assert [name for name, _ in rates.log_fields()] == ["throughput per GPU (TFLOP/s/GPU)", "tokens per second per rank"]

    # MoE: layer 0 dense (SwiGLU 128), layer 1 top-2 of 4 experts (64 each) + a shared expert (32)
    moe = _args(["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                 "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "[0,1]", "--kv-channels", "8"])
    hand = _hand_flops(8, 32, 64, 2, q=32, kv=16, ffn_gemms=[128] * 3 + [64] * 3 * 2 + [32] * 3, vocab=384)
    assert num_floating_point_operations(ModelSize.from_args(moe), 8) == pytest.approx(hand, rel=1e-12)


# ------------------------------------------------------------ start-up checks
@pytest.mark.parametrize("package, argv, pattern", [
    ("tensorboard", ["--tensorboard-dir", "tb"], "--tensorboard-dir needs the tensorboard package.*pip install "
                                                   "tensorboard"),
    ("wandb", ["--wandb-project", "p"], "--wandb-project needs the wandb package.*pip install wandb"),
    (None, ["--log-timers-to-tensorboard"], "needs --tensorboard-dir"),
    (None, ["--wandb-exp-name", "x"], "need --wandb-project"),
])
def test_writer_startup_errors(monkeypatch, package, argv, pattern):
    if package:
        monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 1)


def test_missing_package_stops_the_job_once(monkeypatch, capsys):
    """From the job's entry point: exit status 2, the message printed by rank 0 only (before any group)."""
    from megatron.fsdp_training.training import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    for rank, printed in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            main(["--mock-data", "--tensorboard-dir", "tb"])
        assert exit_info.value.code == 2
        assert capsys.readouterr().out.count("error: --tensorboard-dir needs the tensorboard package") == printed


def test_hf_tokenizer_error_without_transformers(monkeypatch):
    from megatron.fsdp_training.data.tokenizer import build_tokenizer

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install transformers.*ByteLevelTokenizer"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="/nonexistent")


# ------------------------------------------- HF tokenizer -> preprocess -> training with writers
def _corpus():
    """Local text that needs no download: chunks of 30 lines of the standard library's json package."""
    docs = []
    for path in sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"))):
        lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
        docs += ["".join(lines[i:i + 30]) for i in range(0, len(lines), 30)]
    return docs


def _wandb_history(save_dir):
    """History rows of the offline run: its .wandb file is a LevelDB-style log of protobuf records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(Path(save_dir) / "wandb" / "offline-run-*" / "*.wandb"))
    data, pos, block, records, pending = Path(path).read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            records.append(pending)
    rows = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    return rows


LINE = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): [0-9.]+ \| throughput per GPU "
                  r"\(TFLOP/s/GPU\): ([0-9.]+) \| tokens per second per rank: ([0-9.]+) \| learning rate: "
                  r"([0-9.E+-]+) \|.*\| lm loss: ([0-9.E+-]+) \| grad norm: ([0-9.]+) \|")


def _close(a, printed, digits):
    return abs(a - printed) <= 0.5 * 10 ** -digits * max(abs(printed), 1e-30) * 1.01 + 1e-7 * abs(a)


def test_hf_tokenizer_preprocess_train_and_scalars(mcore_pool, tmp_path):
    """A BPE trained here -> preprocess_data.py (round trip) -> 4-rank Llama ZeRO-3 run with
    --log-throughput, TensorBoard, offline wandb and timers: every scalar equals its log line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.fsdp_training.data.tokenizer import build_tokenizer

    docs = _corpus()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tok_dir = train_tokenizer([str(corpus)], 384, str(tmp_path / "bpe"))
    from megatron.fsdp_training.tools import preprocess_data as tool

    prefix = str(tmp_path / "data" / "stdlib")
    assert tool.main(["--input", str(corpus), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                      tok_dir, "--output-prefix", prefix, "--append-eod"]) == 0
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_dir)
    dataset = IndexedDataset(prefix + "_text_document")
    assert len(dataset) == len(docs) and tokenizer.vocab_size == 384
    assert all(tokenizer.detokenize(dataset[i].tolist()[:-1]) == d for i, d in enumerate(docs))  # exact round trip
    assert all(dataset[i][-1] == tokenizer.eod for i in range(len(docs)))

    tb, wb = tmp_path / "tb", tmp_path / "wandb"
    argv = SHAPE + ["--data-path", prefix + "_text_document", "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", tok_dir, "--split", "90,10,0", "--train-iters", "3", "--eval-interval", "3",
                    "--eval-iters", "1", "--lr", "1e-3", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                    "optim_grads_params", "--log-throughput", "--tensorboard-dir", str(tb),
                    "--log-timers-to-tensorboard", "--wandb-project", "llama13", "--wandb-exp-name", "test",
                    "--wandb-save-dir", str(wb)]
    result = mcore_pool.run(pretrain_in_pool, timeout=300, argv=argv,
                            capture_log=True)[0]
    stdout = result["log"]
    lines = {int(m[0]): [float(v) for v in m[1:]] for m in LINE.findall(stdout)}
    assert sorted(lines) == [1, 2, 3], stdout[-3000:]
    assert result["losses"][-1] < result["losses"][0]

    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    events.Reload()
    board = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    history = _wandb_history(wb)
    for it, (tflops, tokens, lr, loss, norm) in lines.items():
        for key, printed, digits in (("throughput", tflops, None), ("tokens-per-second-per-rank", tokens, None),
                                     ("learning-rate", lr, 6), ("lm loss", loss, 6), ("grad-norm", norm, None)):
            for source in (board[key][it], history[it][key]):
                if digits is None:  # printed with a fixed number of decimals
                    decimals = len(str(printed).split(".")[1]) if key == "grad-norm" else 1
                    assert abs(source - printed) <= 0.5 * 10 ** -decimals + 1e-6 * abs(printed), (key, it)
                else:
                    assert _close(source, printed, digits), (key, it, source, printed)
        assert board["batch-size"][it] == 8 and board["iteration-time"][it] > 0
        fwd_bwd, sync, opt = (board[f"{t}-time"][it] for t in ("forward-backward", "all-grads-sync", "optimizer"))
        assert 0 < sync <= fwd_bwd and opt > 0, (fwd_bwd, sync, opt)
    peak = float(re.search(r"^ peak memory \(MiB\) per rank: (\d+)", stdout, re.M).group(1))  # iteration 1's line
    assert abs(board["mem-max-allocated-bytes"][1] / 2**20 - peak) <= 0.5  # the same reading, printed rounded
    valid = float(re.search(r"validation loss at iteration 3 \| lm loss value: ([0-9.E+-]+)", stdout).group(1))
    assert _close(board["lm loss validation"][3], valid, 6) and _close(history[3]["lm loss validation"], valid, 6)
    assert math.isfinite(valid)
