"""Megatron-LM's own trainer (``megatron.training`` from the megatron-core wheel) with this backend behind
``--use-megatron-fsdp``, as ``python -m megatron.fsdp.mcore.megatron_lm SCRIPT`` runs it.

``trainer_scripts/pretrain_gpt.py`` is a script in the shape of Megatron-LM's ``pretrain_gpt.py`` that records every
micro-batch's loss. The runs below are real multi-process runs on CPU ranks (gloo), launched by
``tests/training/fork_launch.py`` (one import, the ranks forked), made once per session: the same losses and grad
norms as Megatron-Core's DDP (fp32, 1e-6 relative) dense + SwiGLU, at level optim without overlap, TP2 + SP x DP2 with
overlap, PP2 x VPP2 x DP2 with the tied embedding, HSDP (two optimizer instances) and MoE EP2, the learning rate
and params norm in Megatron-LM's log line, a save at iteration 2 that resumes to 4 equal to the uninterrupted run (bitwise at the same
layout, within 1e-6 at another data-parallel size and level), and checkpoints moving between this project's own
``pretrain_gpt.py`` and Megatron-LM's trainer through ``tools/checkpoint/convert.py`` (and one line each way without).
"""

import functools
import json
import re
from pathlib import Path

import pytest

from megatron.fsdp.commands import CONVERT as CONVERT_COMMAND
from megatron.fsdp_training.testing.job import LINE
from tests.cases.job_runs import assert_close, launch_runs

SCRIPT = str(Path(__file__).parent / "trainer_scripts" / "pretrain_gpt.py")
CONVERT = str(Path(__file__).resolve().parents[2] / "tools" / "checkpoint" / "convert.py")
SHAPE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 1 --mock-data --tokenizer-type NullTokenizer --seed 1234 --hidden-dropout 0 "
         "--attention-dropout 0 --clip-grad 1.0 --swiglu --log-interval 1 --log-params-norm").split()
# Megatron-LM 0.19's NullTokenizer has --vocab-size entries, this job's one more: 128 rows either way.
TRAINER = SHAPE + ("--vocab-size 128 --transformer-impl local --no-gradient-accumulation-fusion "
                   "--no-masked-softmax-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion --no-rope-fusion "
                   "--no-persist-layer-norm --eval-iters 0 --eval-interval 1000 --split 100,0,0 "
                   "--distributed-backend gloo").split()
JOB = SHAPE + "--vocab-size 127 --eval-iters 1 --eval-interval 1000".split()
ZERO3 = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --use-distributed-optimizer "
         "--ckpt-format fsdp_dtensor").split()
MOE = ("--num-experts 4 --expert-model-parallel-size 2 --moe-router-topk 2 --disable-bias-linear "
       "--moe-token-dispatcher-type alltoall").split()


def level(name: str) -> list:
    """``--use-megatron-fsdp`` at sharding level ``name`` with the distributed optimizer and ``fsdp_dtensor``."""
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", name, "--use-distributed-optimizer",
            "--ckpt-format", "fsdp_dtensor"]


OPTIM_GRADS = level("optim_grads")
# 2 pipeline stages of 2 interleaved virtual stages (one layer each); the embedding and output layer, on the first and
# the last stage, tied (the default)
VPP = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
EVAL = ["--eval-iters", "1", "--eval-interval", "2", "--split", "90,10,0"]


VALIDATION = re.compile(r"validation loss at iteration (\d+) .*?lm loss value: ([0-9.E+-]+)")


def trainer_run(name: str, nproc: int, *flags: str) -> dict:
    return {"name": name, "nproc": nproc, "trainer": "megatron_lm", "argv": [SCRIPT, *TRAINER, *flags]}


def cached(runs: list, work: Path) -> list:
    """Megatron-LM's runs share one dataset-index cache (``--data-cache-path``): the first builds it, the others
    start after it and read it."""
    trainer = [run for run in runs if run.get("trainer") == "megatron_lm"]
    for run in trainer:
        run["argv"] = run["argv"] + ["--data-cache-path", str(work / "index_cache")]
        if run is not trainer[0]:
            run["after"] = sorted(set(run.get("after", [])) | {trainer[0]["name"]})
    return runs


def job_run(name: str, nproc: int, *flags: str) -> dict:
    return {"name": name, "nproc": nproc, "argv": [*JOB, *flags]}


def losses(spec: dict, out: Path, log: str) -> dict:
    """Per-iteration losses: Megatron-LM's trainer's from the script's records (summed over data-parallel ranks),
    the job's from its log line."""
    if spec.get("trainer") != "megatron_lm":
        return {"losses": {int(i): float(loss) for i, loss, _ in LINE.findall(log)}}
    sums = {}
    for path in out.glob("rank*.json"):
        for iteration, loss, tokens in json.loads(path.read_text()):
            total = sums.setdefault(iteration + 1, [0.0, 0])
            total[0], total[1] = total[0] + loss, total[1] + tokens
    norms = json.loads((out / "norms.json").read_text()) if (out / "norms.json").exists() else []
    return {"losses": {it: loss / tokens for it, (loss, tokens) in sorted(sums.items())},
            "grad_norms": {it: grad for it, grad, _ in norms}, "params_norms": {it: params for it, _, params in norms},
            "validation": dict(VALIDATION.findall(log))}


def convert_run(name: str, *argv: str, after=()) -> dict:
    """``tools/checkpoint/convert.py ARGV`` as a run between runs (docs/trainers.md shows these commands)."""
    return {"name": name, "nproc": 1, "trainer": "script", "argv": [CONVERT, *argv], "after": list(after)}


@functools.lru_cache(maxsize=None)
def _runs(work: str) -> dict:
    work = Path(work)
    ckpt, job_ckpt, vpp_ckpt = str(work / "ckpt"), str(work / "job_ckpt"), str(work / "vpp_ckpt")
    as_trainer, as_job = str(work / "job_as_trainer"), str(work / "trainer_as_job")
    runs = [
        trainer_run("ddp", 2),
        trainer_run("zero3", 2, *ZERO3, "--save", ckpt, "--save-interval", "2"),  # saves at 2 and goes on
        job_run("job", 2, "--use-megatron-fsdp", "--save", job_ckpt, "--save-interval", "2"),
        trainer_run("ddp_tp2", 4, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        trainer_run("zero3_tp2", 4, "--tensor-model-parallel-size", "2", "--sequence-parallel", *ZERO3,
                    "--overlap-grad-reduce", "--overlap-param-gather"),
        # the layouts Megatron-LM's schedule drives differently: pipeline stages sharing the tied embedding,
        # interleaved virtual stages, the once-per-step reduction without --overlap-grad-reduce, two optimizer
        # instances (HSDP)
        trainer_run("ddp_vpp", 4, *VPP, *EVAL),
        {**trainer_run("zero3_vpp", 4, *VPP, *EVAL, *ZERO3, "--overlap-grad-reduce", "--overlap-param-gather",
                       "--async-save", "--save", vpp_ckpt, "--save-interval", "2"), "after": ["ddp_vpp"]},
        {**trainer_run("resume_vpp_dp1", 2, *VPP, *EVAL, *OPTIM_GRADS, "--load", vpp_ckpt, "--ckpt-step", "2"),
         "after": ["zero3_vpp"]},
        trainer_run("optim", 2, *level("optim")),
        trainer_run("hsdp", 4, *ZERO3, "--num-distributed-optimizer-instances", "2"),
        trainer_run("ddp_moe", 2, *MOE),
        trainer_run("zero3_moe", 2, *MOE, *ZERO3),
        {**trainer_run("resume", 2, *ZERO3, "--load", ckpt, "--ckpt-step", "2"), "after": ["zero3"]},
        {**trainer_run("resume_dp1", 1, *OPTIM_GRADS, "--load", ckpt, "--ckpt-step", "2"), "after": ["zero3"]},
        # each handed the other's checkpoint as it is: one line naming the converter
        {**trainer_run("trainer_loads_job", 2, *ZERO3, "--load", job_ckpt, "--ckpt-step", "2"), "after": ["job"],
         "failing": True},
        {**job_run("job_loads_trainer", 2, "--use-megatron-fsdp", "--load", ckpt, "--ckpt-step", "2"),
         "after": ["zero3"], "failing": True},
        convert_run("to_trainer", "to-megatron-lm", job_ckpt, as_trainer, "--iteration", "2", after=["job"]),
        convert_run("to_job", "from-megatron-lm", ckpt, as_job, "--iteration", "2", after=["zero3"]),
        {**trainer_run("trainer_from_job", 2, *ZERO3, "--load", as_trainer), "after": ["to_trainer"]},
        {**job_run("job_from_trainer", 2, "--use-megatron-fsdp", "--load", as_job), "after": ["to_job"]},
    ]
    return launch_runs(work, cached(runs, work), losses)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _runs(str(tmp_path_factory.mktemp("megatron_lm")))


def _field(line: str, name: str) -> str:
    return re.search(name + r": ([^ |]+)", line).group(1)


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_zero3_gives_megatron_core_ddp_losses_and_logs_lr_and_params_norm(runs):
    base, ours = runs["ddp"], runs["zero3"]
    assert sorted(ours["losses"]) == [1, 2, 3, 4]
    assert_close(ours["losses"], base["losses"], 1e-6, [1, 2, 3, 4])
    lines = [line for line in ours["log"].splitlines() if re.search(r"iteration +\d+/ +4 \|", line)]
    base_lines = [line for line in base["log"].splitlines() if re.search(r"iteration +\d+/ +4 \|", line)]
    assert len(lines) == len(base_lines) == 4, ours["log"][-3000:]
    for line, base_line in zip(lines, base_lines):  # Megatron-LM's rounding of the same numbers
        for field in ("learning rate", "grad norm", "params norm"):
            assert _field(line, field) == _field(base_line, field), (line, base_line)
    assert ours["log"].count("fsdp_dtensor: Megatron-Core's preprocessing") == 1  # said once, by rank 0


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_save_at_2_resumes_to_4_bitwise_and_at_another_data_parallel_size_and_level(runs):
    ours = runs["zero3"]["losses"]
    assert runs["resume"]["losses"] == {it: ours[it] for it in (3, 4)}
    assert sorted(runs["resume_dp1"]["losses"]) == [3, 4]
    assert_close(runs["resume_dp1"]["losses"], ours, 1e-6, [3, 4])


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_tp2_dp2_sequence_parallel_with_overlap_gives_ddp_training(runs):
    _same_training(runs["zero3_tp2"], runs["ddp_tp2"])


def _same_training(ours: dict, base: dict, iterations=(1, 2, 3, 4)) -> None:
    """Losses and exact grad norms equal within 1e-6 relative (fp32) at every iteration, params norms too."""
    assert sorted(ours["losses"]) == list(iterations), ours["log"][-3000:]
    for field in ("losses", "grad_norms", "params_norms"):
        assert_close(ours[field], base[field], 1e-6, iterations)


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_interleaved_pipeline_stages_sharing_the_tied_embedding_give_ddp_training_and_validation(runs):
    """PP2 x VPP2 x DP2, the embedding tied to the output layer on the other stage: its two gradients are summed
    across the stages (Megatron-Core's ``finalize_model_grads`` cannot read them from a sharded parameter; left to
    it, each stage stepped on its half: at PP2 x DP2 grad norm 0.815 for DDP's 1.021)."""
    ours, base = runs["zero3_vpp"], runs["ddp_vpp"]
    _same_training(ours, base)
    assert sorted(ours["validation"]) == ["2", "4"] and ours["validation"] == base["validation"], ours["validation"]


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_pipeline_async_save_resumes_at_another_data_parallel_size_and_level(runs):
    assert sorted(runs["resume_vpp_dp1"]["losses"]) == [3, 4]
    for field in ("losses", "grad_norms"):
        assert_close(runs["resume_vpp_dp1"][field], runs["zero3_vpp"][field], 1e-6, [3, 4])


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_once_per_step_reductions_without_overlap_give_ddp_training(runs):
    """Without ``--overlap-grad-reduce`` Megatron-LM's schedule runs no micro-batch under ``no_sync``: level
    ``optim``'s all-reduce, and HSDP's across the two optimizer instances, wait for ``finish_grad_sync`` (run in
    every backward they counted the earlier micro-batches again: grad norm 1.071 for DDP's 1.039)."""
    _same_training(runs["optim"], runs["ddp"])
    _same_training(runs["hsdp"], runs["ddp"])


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_moe_ep2_gives_ddp_losses(runs):
    assert sorted(runs["zero3_moe"]["losses"]) == [1, 2, 3, 4]
    assert_close(runs["zero3_moe"]["losses"], runs["ddp_moe"]["losses"], 1e-6, [1, 2, 3, 4])


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_checkpoints_move_between_this_job_and_megatron_lm_trainer(runs):
    # this job's checkpoint, converted, continues in Megatron-LM's trainer as in the job; and the other way
    assert_close(runs["trainer_from_job"]["losses"], runs["job"]["losses"], 1e-6, [3, 4])
    assert_close(runs["job_from_trainer"]["losses"], runs["zero3"]["losses"], 1e-6, [3, 4])


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_each_trainer_names_the_converter_for_the_others_checkpoint(runs):
    for name, command in (("trainer_loads_job", "to-megatron-lm"), ("job_loads_trainer", "from-megatron-lm")):
        log = runs[name]["log"]
        assert runs[name]["status"] != 0 and log.count(f"{CONVERT_COMMAND} {command}") == 1, log[-3000:]


@pytest.mark.mcore_only("not HAS_MEGATRON_TRAINING", why="megatron-core before 0.17 ships no megatron.training")
def test_the_runner_refuses_with_one_line_without_megatron_training(tmp_path):
    import subprocess
    import sys

    from megatron.fsdp_training.testing.job import ROOT

    done = subprocess.run([sys.executable, "-m", "megatron.fsdp.mcore.megatron_lm", SCRIPT, "--use-megatron-fsdp"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ships no megatron.training" in lines[0] and "pretrain_gpt.py" in lines[0], lines


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="megatron-core ships Megatron-LM's megatron.training from 0.17")
def test_the_trainers_parameter_groups_become_the_engines_or_are_refused():
    """Megatron-LM's standard ``config_overrides`` (no decay for biases and 1-D parameters, --decoupled-lr) are the
    engine's no-decay rule; an override it cannot honour (muP's per-class learning rates) stops with one line."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey

    from megatron.fsdp.mcore.trainer_backend import no_weight_decay_rule

    config = OptimizerConfig(lr=1e-3, decoupled_lr=1e-4)
    rule = no_weight_decay_rule(get_standard_config_overrides(config))
    matrix, vector = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    assert not rule("decoder.layers.0.mlp.linear_fc1.weight", matrix)
    assert rule("decoder.layers.0.mlp.linear_fc1.bias", vector) and rule("decoder.final_layernorm.weight", vector)
    with pytest.raises(ValueError, match="optimizer overrides are not supported: .*lr_mult"):
        no_weight_decay_rule({ParamKey(name="*.linear_fc1.weight"): {"lr_mult": 0.5}})
