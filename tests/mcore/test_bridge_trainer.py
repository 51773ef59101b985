"""Megatron-Bridge 0.6.2 with this backend behind ``cfg.ddp.use_megatron_fsdp = True`` after ``bridge.install()``.

Bridge is installed ``--no-deps`` with the light packages its import needs (the README's Python 3.12 line); what this
machine cannot install (Transformer Engine, nvidia-resiliency-ext) the harness stands in for
(``trainer_scripts/bridge_standins.py``, never the installed package). The runs are real 2-rank CPU runs (gloo)
launched by ``tests/training/fork_launch.py``, made once per session: Bridge's ``pretrain()`` gives Megatron-Core
DDP's losses at ZeRO-3, dense, SwiGLU, TP2 x DP2, PP2 x DP2 with the tied embedding, level optim and MoE EP2; a
save at 3 resumes to 6 bitwise (and on one rank at another level within 1e-6); AutoBridge imports a HuggingFace
Llama into a model wrapped at every level with HF's logits, exports HF's tensors back (full, never empty) and loads HF
weights into an already wrapped model.
"""

import functools
import json
from pathlib import Path

import pytest

from tests.cases.job_runs import assert_close, launch_runs

SCRIPTS = Path(__file__).parent / "trainer_scripts"
LEVELS = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _run(name: str, script: str, *argv: str, nproc: int = 2) -> dict:
    return {"name": name, "nproc": nproc, "trainer": "bridge", "argv": [str(SCRIPTS / script), *argv]}


def records(spec: dict, out: Path, log: str) -> dict:
    """The lowest rank's with the loss (rank 0, or the last pipeline stage's first): per-iteration loss and grad norm
    (Bridge's data-parallel-reduced ``lm loss``), by iteration."""
    files = sorted(out.glob("rank*.json"), key=lambda path: int(path.stem[4:]))
    rows = json.loads(files[0].read_text()) if files else []
    return {"losses": {step + 1: loss for step, loss, _ in rows}, "grad_norms": {step + 1: norm for step, _, norm in rows}}


@functools.lru_cache(maxsize=None)
def _runs(work: str) -> dict:
    work = Path(work)
    ckpt = str(work / "ckpt")
    cache = ("--data-cache", str(work / "index_cache"))  # the dataset indices: the first run builds them
    runs = [
        _run("ddp", "bridge_pretrain.py"),
        _run("zero3", "bridge_pretrain.py", "--fsdp", "optim_grads_params", "--save", ckpt, "--save-interval", "3"),
        {**_run("resume", "bridge_pretrain.py", "--fsdp", "optim_grads_params", "--load", ckpt, "--ckpt-step", "3"),
         "after": ["zero3"]},
        {**_run("resume_dp1", "bridge_pretrain.py", "--fsdp", "optim_grads", "--load", ckpt, "--ckpt-step", "3",
                nproc=1), "after": ["zero3"]},
        _run("ddp_dense", "bridge_pretrain.py", "--gelu"),
        _run("zero3_dense", "bridge_pretrain.py", "--gelu", "--fsdp", "optim_grads_params"),
        _run("ddp_tp2", "bridge_pretrain.py", "--tp", "2", nproc=4),
        _run("zero3_tp2", "bridge_pretrain.py", "--tp", "2", "--fsdp", "optim_grads_params", nproc=4),
        # pipeline stages sharing the tied embedding; the once-per-step reduction of level optim without overlap
        _run("ddp_pp2_tied", "bridge_pretrain.py", "--pp", "2", "--tied", nproc=4),
        _run("zero3_pp2_tied", "bridge_pretrain.py", "--pp", "2", "--tied", "--overlap", "--fsdp", "optim_grads_params",
             nproc=4),
        _run("optim", "bridge_pretrain.py", "--fsdp", "optim"),
        _run("ddp_moe", "bridge_pretrain.py", "--moe"),
        _run("zero3_moe", "bridge_pretrain.py", "--moe", "--fsdp", "optim_grads_params"),
    ]
    for run in runs:
        run["argv"] += cache
        if run is not runs[0]:  # every run reads the first one's cache (all train 6 iterations: one cache entry)
            run["after"] = sorted(set(run.get("after", [])) | {"ddp"})
    runs.append(_run("autobridge", "autobridge_roundtrip.py", ",".join(LEVELS), str(work / "autobridge")))
    results = launch_runs(work, runs, records)  # (the AutoBridge run writes into its own folder)
    results["autobridge"]["result"] = json.loads((work / "autobridge" / "result.json").read_text())
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _runs(str(tmp_path_factory.mktemp("bridge")))


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="Megatron-Bridge 0.6.2 runs on megatron-core 0.19 (Python 3.12), which ships megatron.training")
def test_pretrain_at_zero3_gives_ddp_losses_swiglu_and_dense(runs):
    assert_close(runs["zero3"]["losses"], runs["ddp"]["losses"], 1e-6, range(1, 7))
    assert_close(runs["zero3"]["grad_norms"], runs["ddp"]["grad_norms"], 1e-5, range(1, 7))
    assert_close(runs["zero3_dense"]["losses"], runs["ddp_dense"]["losses"], 1e-6, range(1, 7))
    log = runs["zero3"]["log"]
    assert log.count("> megatron.fsdp: 1 model chunk(s) at optim_grads_params over 2 data-parallel ranks") == 1, log
    assert "> megatron.fsdp:" not in runs["ddp"]["log"]  # DDP stays Megatron-Core's


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="Megatron-Bridge 0.6.2 runs on megatron-core 0.19 (Python 3.12), which ships megatron.training")
def test_pretrain_at_zero3_gives_ddp_losses_tp2_dp2_and_moe_ep2(runs):
    for case in ("tp2", "moe"):
        assert sorted(runs[f"zero3_{case}"]["losses"]) == [1, 2, 3, 4, 5, 6]
        assert_close(runs[f"zero3_{case}"]["losses"], runs[f"ddp_{case}"]["losses"], 1e-6, range(1, 7))


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="Megatron-Bridge 0.6.2 runs on megatron-core 0.19 (Python 3.12), which ships megatron.training")
def test_pretrain_pp2_tied_embedding_and_level_optim_without_overlap_give_ddp_training(runs):
    """The tied embedding's gradients summed across the stages, and level optim's all-reduce once per step, though
    Bridge's schedule (like Megatron-LM's) runs no micro-batch under no_sync without overlap_grad_reduce."""
    for ours, base in (("zero3_pp2_tied", "ddp_pp2_tied"), ("optim", "ddp")):
        assert sorted(runs[ours]["losses"]) == [1, 2, 3, 4, 5, 6], runs[ours]["log"][-3000:]
        assert_close(runs[ours]["losses"], runs[base]["losses"], 1e-6, range(1, 7))
        assert_close(runs[ours]["grad_norms"], runs[base]["grad_norms"], 1e-5, range(1, 7))


@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="Megatron-Bridge 0.6.2 runs on megatron-core 0.19 (Python 3.12), which ships megatron.training")
def test_save_at_3_resumes_to_6_bitwise_and_at_another_data_parallel_size_and_level(runs):
    assert sorted(runs["resume"]["losses"]) == [4, 5, 6]
    assert runs["resume"]["losses"] == {it: runs["zero3"]["losses"][it] for it in (4, 5, 6)}
    assert runs["resume"]["grad_norms"] == {it: runs["zero3"]["grad_norms"][it] for it in (4, 5, 6)}
    assert sorted(runs["resume_dp1"]["losses"]) == [4, 5, 6]  # one rank, optim_grads
    assert_close(runs["resume_dp1"]["losses"], runs["zero3"]["losses"], 1e-6, (4, 5, 6))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.mcore_only("HAS_MEGATRON_TRAINING", why="Megatron-Bridge 0.6.2 runs on megatron-core 0.19 (Python 3.12), which ships megatron.training")
def test_autobridge_import_and_export_at_every_level(runs, level):
    result = runs["autobridge"]["result"][level]
    assert result["wrapper"] == "megatron.fsdp.mcore.data_parallel.FullyShardedDataParallel"
    assert result["logits_gap"] <= 1e-5, result
    assert result["exported"] == result["expected"] and not result["empty"], result
    assert result["export_gap"] == 0.0, result
    assert result["fresh_logits_gap"] > 1e-2 and result["imported_logits_gap"] <= 1e-5, result
