"""The wrapped model keeps the unwrapped model's whole surface at ZeRO-3 (issue 40): transformers'
``generate()``, a method of the user's own class, eval forwards under ``torch.no_grad()``, and
submodules called on their own (forward and backward) give the unwrapped model's results, leave
nothing gathered, and training afterwards is bitwise what it would have been.

The rules are in docs/engine.md, "Using the engine with Hugging Face models".
"""

import pytest

from megatron.fsdp.testing.common import LEVELS
from megatron.fsdp_training.testing.pools import pool_of
from tests.cases.model_surface import conversions, frozen_training, hf_surface, submodule_trained_alone


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


def test_frozen_parameters_train_like_the_unwrapped_model_at_every_level():
    """LoRA-style training: a tiny Llama whose root is frozen, with only every layer's ``q_proj`` trainable, and
    one with LoRA A/B pairs on layer 0 beside frozen projections (layers 1 and 2: units whose parameters are
    all frozen), at every level on 2 ranks, against the unwrapped model under plain AdamW. ZeRO-3 raised
    before (a shape mismatch against an empty weight): a unit was released once its own gradients were in,
    while its frozen weights still had to pass the gradient on to the layers before it."""
    ranks = pool_of(2).run(frozen_training, timeout=180)
    for kind, frozen_units in (("q_proj", ["<root>"]), ("lora", ["<root>", "model.layers.1", "model.layers.2"])):
        for level in LEVELS:
            checks = dict(ranks[0][f"{kind} {level}"])
            gathered = checks.pop("gathered")  # (unit whose backward ended, units still gathered then)
            if level == "optim_grads_params":  # each layer released as its backward ends, frozen ones too
                layers = ["model.layers.2", "model.layers.1", "model.layers.0", "<root>"]
                assert [name for name, _ in gathered] == 2 * layers, gathered
                assert all(len(still) <= 2 for _, still in gathered), gathered  # the root and one prefetched
            # no memory for frozen parameters' gradients: each rank keeps its part of the trainable ones only
            copies = len(ranks) if level in ("no_shard", "optim") else 1
            assert sum(r[f"{kind} {level}"]["grad bytes"] for r in ranks) == copies * checks.pop("trainable bytes")
            checks.pop("grad bytes")
            assert checks.pop("stepped") == checks.pop("trainable"), (kind, level)
            assert checks == {"loss": 0.0, "weights": 0.0, "frozen units": frozen_units,
                              "frozen units reduced or given gradients": [], "released": True}, (kind, level, checks)


def test_to_keeps_the_sharded_dtype_and_device_or_says_how():
    """``.to()`` and its kin: a dtype or device change raises one line naming the supported way (it did nothing
    at ZeRO-3 before, logits stayed float32; at no_shard it swapped the parameters for copies the optimizer
    never updated); a call that changes nothing (the dtype or device the model has) returns the model, and
    it computes and trains as before (bitwise against the unwrapped model)."""
    results = pool_of(2).run(conversions, timeout=120)[0]
    unchanged = ["to(float32)", "float()", "to(cpu)", "cpu()", "module.to(cpu, float32)"]
    for key, checks in results.items():
        bf16 = key.endswith("bf16")
        refused = {"half()": "float16", "double()": "float64", "module.to(float16)": "float16"}
        refused.update({} if bf16 else {"to(bfloat16)": "bfloat16", "bfloat16()": "bfloat16"})
        for call, dtype in refused.items():
            message = checks.pop(call)
            assert f"pass mixed_precision=MixedPrecision(param_dtype=torch.{dtype}) to fully_shard" in message, (key, message)
            assert "\n" not in message
        assert "move the module before fully_shard" in checks.pop("to(meta)"), key
        kept = unchanged + (["to(bfloat16)", "bfloat16()"] if bf16 else [])
        assert {call: checks.pop(call) for call in kept} == dict.fromkeys(kept, "ok"), key
        # buffers follow as on the unwrapped model (the last call was to float32)
        assert checks.pop("rotary buffer") == "torch.float32", key
        assert checks == ({"logits": "torch.bfloat16", "rotary buffer after to(bfloat16)": "torch.bfloat16"} if bf16 else
                          {"logits": "torch.float32", "loss": 0.0, "weights": 0.0}), (key, checks)
