"""The wrapped model keeps the unwrapped model's whole surface at ZeRO-3 (issue 40): transformers'
``generate()``, a method of the user's own class, eval forwards under ``torch.no_grad()``, and
submodules called on their own (forward and backward) give the unwrapped model's results, leave
nothing gathered, and training afterwards is bitwise what it would have been.

The rules are in docs/engine.md, "Using the engine with Hugging Face models".
"""

import pytest

from megatron.fsdp_training.testing.pools import pool_of
from tests.cases.model_surface import hf_surface, submodule_trained_alone


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_hf_model_keeps_its_surface_at_zero3(family):
    """Greedy ``generate()`` of a tiny Llama (untied) and a tiny Mixtral (MoE, tied head) wrapped at
    optim_grads_params on 2 ranks gives the unsharded model's tokens; so do the other uses. The
    2-rank pool, whose world is those two ranks: transformers' ``synced_gpus`` all-reduces over it."""
    ranks = pool_of(2).run(hf_surface, timeout=120, family=family)
    checks = ranks[0]
    assert checks.pop("ledger") == ranks[1]["ledger"], "the ranks issued different collectives"
    assert checks.pop("length generated") < ranks[1]["length generated"]  # the ranks' loops differ
    assert checks == {
        "generate": True, "released after generate": True, "generate, a prompt per rank (synced_gpus)": True,
        "score": True, "eval forward": True,
        "eval forward of model.module": True, "embedding called directly": True, "lm_head called directly": True,
        "unit's submodule called directly": True, "released after direct calls": True, "trains as before": True,
    }, checks


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_submodule_called_alone_trains_like_the_unwrapped_one(pool, strategy):
    """A unit's submodule called on its own: its output, its gradient step and the next whole-model
    step equal the unwrapped model's bitwise (they raised before: an empty weight at ZeRO-3, a gradient
    "outside that unit's backward" at optim_grads)."""
    checks = pool.run(submodule_trained_alone, size=2, strategy=strategy)[0]
    losses = checks.pop("losses")
    assert losses[0] == losses[1], losses
    assert checks == {"output": True, "released after forward": True, "stepped": [], "then trained": [],
                      "released at the end": True}, checks
