"""Migrating a Megatron-Core DistributedOptimizer MoE run mid-training (the user guide's second half):
EP 2, dropout on, saved as torch_dist at iteration 5 in Megatron-LM's default optimizer layout
(dp_reshardable: flat buckets), converted with its Adam state and RNG states, resumed with --use-megatron-fsdp at ZeRO-3, continues
within 1e-5 of the same baseline resumed from its own checkpoint (losses and grad norms, iterations 6-10).
The dense case: test_torch_dist.py."""

from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp_training.tools.checkpoint_tools import convert
from tests.cases.job_runs import B8, MODEL, assert_exact_resume, pretrain

MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
       "--disable-bias-linear"]
DROPOUT = ["--hidden-dropout", "0.1"]  # the converted RNG states give the resumed run the baseline's masks
# hidden 48: parameter sizes that are not multiples of 64 leave padding between them in the dp_reshardable buckets
MODEL = MODEL + ["--hidden-size", "48"]
BASELINE = MODEL + B8 + MOE + DROPOUT + ["--use-distributed-optimizer"]


def _close(got, expected, rtol=1e-5):
    assert len(got) == len(expected) and all(rel(a, b) < rtol for a, b in zip(got, expected)), (got, expected)


def test_moe_ep2_torch_dist_resumes_under_zero3(tmp_path):
    td, converted = tmp_path / "torch_dist", tmp_path / "fsdp"
    straight = pretrain(2, BASELINE + ["--save", str(td), "--save-interval", "5"])
    own = pretrain(2, BASELINE + ["--load", str(td), "--ckpt-step", "5"])  # the baseline resumed from its own checkpoint
    assert own["start_iteration"] == 5 and len(own["losses"]) == 5
    convert.main(["from-torch-dist", str(td), str(converted), "--iteration", "5"])
    moved = pretrain(2, MODEL + B8 + MOE + DROPOUT + fsdp("optim_grads_params") + ["--load", str(converted)])
    assert moved["start_iteration"] == 5
    _close(moved["losses"], own["losses"])
    _close(moved["grad_norms"], own["grad_norms"])
    _close([moved["valid_at_load"]] + moved["valid"], [own["valid_at_load"]] + own["valid"])
    assert_exact_resume(straight, own, 5)  # the baseline's own resume is exact
