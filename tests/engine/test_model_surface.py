"""The wrapped model keeps the unwrapped model's whole surface at ZeRO-3: transformers'
``generate()``, a method of the user's own class, eval forwards under ``torch.no_grad()``, and
submodules called on their own (forward and backward) give the unwrapped model's results, leave
nothing gathered, and training afterwards is bitwise what it would have been.

The rules are in docs/engine.md, "Using the engine with Hugging Face models".

transformers is imported inside the HF case only: the pytest process and the pools never pay for it
unless that case runs.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.common import LEVELS
from megatron.fsdp.testing.models import Block, TinyLM, make_batches
from megatron.fsdp_training.testing.pools import pool_of


VOCAB = 64


class _Score:
    """A method of the user's own model class: calls submodules, not the model itself."""

    def score(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=ids).last_hidden_state
        logprobs = torch.log_softmax(self.lm_head(hidden[:, :-1]).float(), dim=-1)
        return logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def _build(family: str):
    """A tiny ``family`` model (seed 0: equal on every rank) whose class has ``score()``."""
    import transformers

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":
        config, base = transformers.LlamaConfig(**shape), transformers.LlamaForCausalLM
    elif family == "mixtral":  # tied: lm_head holds the root unit's embedding under a second name
        config = transformers.MixtralConfig(**shape, num_local_experts=3, num_experts_per_tok=2,
                                            tie_word_embeddings=True)
        base = transformers.MixtralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    return type(f"Scoring{base.__name__}", (_Score, base), {})(config)


def _released(model) -> bool:
    """Nothing gathered: every unit idle, its full weights freed where its level frees them (ZeRO-3)."""
    return all(u.state.value == "idle" and not (u.storage.releases and u.storage.resident) for u in model.units)


def _equal(got: torch.Tensor, want: torch.Tensor):
    """True when bitwise equal, else the largest difference."""
    if got.shape == want.shape and torch.equal(got, want):
        return True
    return f"differs: shapes {tuple(got.shape)} / {tuple(want.shape)}" if got.shape != want.shape else \
        f"differs by {(got.double() - want.double()).abs().max().item():.3g}"


def _train_step(model, optimizer, ctx, batch: torch.Tensor) -> float:
    n = batch.shape[0] // ctx.size
    ids = batch[ctx.rank * n:(ctx.rank + 1) * n]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def hf_surface(ctx, family: str) -> Dict[str, object]:
    """One step, then the model's surface against the unwrapped model holding the same weights, then a
    second step; a twin that only trained must end bitwise equal (losses and weights)."""
    built = {name: _build(family) for name in ("used", "twin", "unsharded")}
    unsharded = built.pop("unsharded")
    layer = type(unsharded.model.layers[0])
    models = {name: mfsdp.fully_shard(module, strategy="optim_grads_params", unit_modules=(layer,),
                                      mesh=ctx.group) for name, module in built.items()}
    optimizers = {name: mfsdp.FullyShardedOptimizer(m, torch.optim.AdamW, lr=1e-2) for name, m in models.items()}
    batches = torch.randint(0, VOCAB, (2, 2 * ctx.size, 12), generator=torch.Generator().manual_seed(1))
    losses = {name: [_train_step(models[name], optimizers[name], ctx, batches[0])] for name in models}
    model = models["used"]
    unsharded.load_state_dict(model.full_state_dict(), strict=False)  # the trained weights, unsharded
    unsharded.eval()
    model.ledger.reset()

    checks: Dict[str, object] = {}

    def check(name, use, want):
        """``use()`` against ``want()``: equal, or what ``use`` raised (one check failing leaves the others)."""
        try:
            got = use()
        except Exception as exc:  # noqa: BLE001  (reported, and the test fails naming it)
            checks[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            return
        checks[name] = _equal(got, want())

    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.eval()
    tokens = unsharded.generate(prompt, **greedy)
    check("generate", lambda: model.module.generate(prompt, **greedy), lambda: tokens)
    checks["released after generate"] = _released(model)
    # Each rank its own prompt, rank 0's stopping at its second token (its eos): transformers'
    # synced_gpus keeps every rank calling the model until all are done, so the gathers still match.
    own = prompt[ctx.rank:ctx.rank + 1]
    stop = dict(greedy, eos_token_id=int(tokens[0, prompt.shape[1] + 1]))
    check("generate, a prompt per rank (synced_gpus)", lambda: model.module.generate(own, synced_gpus=True, **stop),
          lambda: unsharded.generate(own, **stop))
    checks["length generated"] = unsharded.generate(own, **stop).shape[1]  # rank 0 stops first
    with torch.no_grad():
        hidden = unsharded.model.embed_tokens(tokens)
        check("score", lambda: model.module.score(tokens), lambda: unsharded.score(tokens))
        check("eval forward", lambda: model(tokens).logits, lambda: unsharded(tokens).logits)
        check("eval forward of model.module", lambda: model.module(tokens).logits, lambda: unsharded(tokens).logits)
        check("embedding called directly", lambda: model.module.model.embed_tokens(tokens), lambda: hidden)
        check("lm_head called directly", lambda: model.module.lm_head(hidden), lambda: unsharded.lm_head(hidden))
        check("unit's submodule called directly", lambda: model.module.model.layers[1].mlp(hidden),
              lambda: unsharded.model.layers[1].mlp(hidden))
    checks["released after direct calls"] = _released(model)
    model.train()
    checks["ledger"] = model.ledger.summary()  # the same collectives on every rank

    losses["used"].append(_train_step(model, optimizers["used"], ctx, batches[1]))
    losses["twin"].append(_train_step(models["twin"], optimizers["twin"], ctx, batches[1]))
    used, twin = models["used"].full_state_dict(), models["twin"].full_state_dict()
    checks["trains as before"] = losses["used"] == losses["twin"] and all(torch.equal(used[k], twin[k]) for k in used)
    return checks


def submodule_trained_alone(ctx, strategy: str) -> Dict[str, object]:
    """A unit's submodule (``blocks.0.mlp``, not a unit) called on its own, forward and backward, then
    an SGD step, then a whole-model step, against the same calls on the unwrapped model. Every rank
    feeds the same inputs, so the averaged gradients are the reference's exactly."""
    torch.manual_seed(0)
    reference = TinyLM()
    torch.manual_seed(0)
    model = mfsdp.fully_shard(TinyLM(), strategy=strategy, mesh=ctx.group, unit_modules=(Block,))
    optimizer = mfsdp.FullyShardedOptimizer(model, torch.optim.SGD, lr=0.5)
    reference_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    tokens, targets = make_batches(1, 1, 2)[0][0]
    checks: Dict[str, object] = {}
    out, want = model.module.blocks[0].mlp(x), reference.blocks[0].mlp(x)
    checks["output"] = _equal(out, want)
    checks["released after forward"] = _released(model)
    for loss, opt in ((out.square().mean(), optimizer), (want.square().mean(), reference_optimizer)):
        loss.backward()
        opt.step()
        opt.zero_grad()
    trained = model.full_state_dict()
    checks["stepped"] = [n for n, p in reference.named_parameters() if not torch.equal(trained[n], p.detach())]
    losses = []
    for module, opt in ((model, optimizer), (reference, reference_optimizer)):
        loss = module(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trained = model.full_state_dict()
    checks["then trained"] = [n for n, p in reference.named_parameters() if not torch.equal(trained[n], p.detach())]
    checks["losses"] = losses
    checks["released at the end"] = _released(model)
    return checks


class LoRALinear(torch.nn.Module):
    """A frozen projection plus a trainable low-rank A/B pair beside it (LoRA)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _partly_frozen(kind: str):
    """A tiny three-layer Llama (seed 0). ``q_proj``: only every layer's ``q_proj`` trains (the root: embedding,
    final norm, head, is frozen). ``lora``: LoRA pairs on layer 0's ``q_proj`` and ``v_proj`` train and the rest
    is frozen, so layers 1 and 2 are units whose parameters are all frozen (the gradient passes through them to
    layer 0). ``none``: everything trains."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if kind == "lora":
        attention = model.model.layers[0].self_attn
        attention.q_proj, attention.v_proj = LoRALinear(attention.q_proj), LoRALinear(attention.v_proj)
    for name, p in model.named_parameters():
        p.requires_grad_({"lora": "lora_" in name, "q_proj": name.endswith("q_proj.weight")}.get(kind, True))
    return model


def _train_both(ctx, model, reference, steps: int, after_backward=lambda: None):
    """``steps`` AdamW steps of the wrapped ``model`` (each rank its slice of each batch) and of the unwrapped
    ``reference`` on this rank (the slices' gradients averaged as the engine averages them). Returns the largest
    relative difference of the losses and of the weights after (0.0: bitwise), and the trained weights."""
    batches = torch.randint(0, VOCAB, (steps, 2 * ctx.size, 12), generator=torch.Generator().manual_seed(1))
    optimizer = mfsdp.FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    reference_optimizer = torch.optim.AdamW([{"params": [p for p in trainable if p.dim() > 1]},  # the engine's
                                             {"params": [p for p in trainable if p.dim() == 1], "weight_decay": 0.0}],
                                            lr=1e-2, weight_decay=0.1)  # default decay rule: none on norms
    losses = []
    for batch in batches:
        slices = batch.chunk(ctx.size)
        loss = model(input_ids=slices[ctx.rank], labels=slices[ctx.rank]).loss
        loss.backward()
        after_backward()
        optimizer.step()
        optimizer.zero_grad()
        wanted = [reference(input_ids=s, labels=s).loss for s in slices]
        per_slice = [torch.autograd.grad(want, trainable) for want in wanted]
        for p, *grads in zip(trainable, *per_slice):
            p.grad = sum(grads[1:], grads[0]).mul_(1.0 / ctx.size)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        losses.append((loss.detach(), wanted[ctx.rank].detach()))
    trained = model.full_state_dict()
    return {"loss": max(_relative(got, want) for got, want in losses),
            "weights": max(_relative(trained[k], p.detach()) for k, p in reference.named_parameters())}, trained


def frozen_training(ctx, steps: int = 2) -> Dict[str, object]:
    """Each partly frozen model trained at every level against the unwrapped model (``_train_both``): per
    (kind, level) the losses' and weights' differences, what trained, the gradient bytes kept after the first
    backward, and whether any unit whose parameters are all frozen was reduced or got gradient memory."""
    out: Dict[str, object] = {}
    for kind in ("q_proj", "lora"):
        initial = _partly_frozen(kind).state_dict()
        for level in LEVELS:
            reference, module = _partly_frozen(kind), _partly_frozen(kind)
            model = mfsdp.fully_shard(module, strategy=level, unit_modules=(type(module.model.layers[0]),),
                                      mesh=ctx.group)
            model.ledger.trace = True
            frozen_units = [u.name for u in model.units if not u.num_trainable]
            gathered = []  # per unit's end of backward: the units still gathered (ZeRO-3 releases each as it ends)
            model.register_post_backward_hook(
                lambda name: gathered.append((name, [u.name for u in model.units if u.storage.releases and u.storage.resident])))
            grad_bytes = []
            checks, trained = _train_both(ctx, model, reference, steps,
                                          lambda: grad_bytes.append(model.memory_report().main_grads))
            trainable = [(k, p) for k, p in reference.named_parameters() if p.requires_grad]
            out[f"{kind} {level}"] = dict(
                checks,
                stepped=sorted(k for k, _ in trainable if not torch.equal(trained[k], initial[k])),
                trainable=sorted(k for k, _ in trainable),
                **{"grad bytes": grad_bytes[0], "trainable bytes": 4 * sum(p.numel() for _, p in trainable),
                   "frozen units": frozen_units,
                   "frozen units reduced or given gradients": sorted(
                       {e.tag for e in model.ledger.events if e.tag in frozen_units and e.kind != "all_gather"}
                       | {u.name for u in model.units if u.name in frozen_units and u.storage.grad_accum.numel()}),
                   "released": _released(model), "gathered": gathered})
    return out


def conversions(ctx) -> Dict[str, object]:
    """``.to()`` and its kin on a tiny Llama wrapped at no_shard and at ZeRO-3 (fp32), and at ZeRO-3 under bf16
    mixed precision: what each call raised (its first line) or ``"ok"`` (it returned the model), the logits'
    dtype after them, and (fp32) two training steps after them against the unwrapped model (``_train_both``)."""
    out: Dict[str, object] = {}
    for level, precision in (("no_shard", None), ("optim_grads_params", None),
                             ("optim_grads_params", mfsdp.MixedPrecision(param_dtype=torch.bfloat16))):
        reference, module = _partly_frozen("none"), _partly_frozen("none")
        model = mfsdp.fully_shard(module, strategy=level, unit_modules=(type(module.model.layers[0]),),
                                  mesh=ctx.group, mixed_precision=precision)
        calls = {"to(bfloat16)": lambda: model.to(torch.bfloat16), "half()": model.half,
                 "bfloat16()": model.bfloat16, "double()": model.double, "to(meta)": lambda: model.to("meta"),
                 "module.to(float16)": lambda: model.module.to(torch.float16),
                 "to(float32)": lambda: model.to(torch.float32), "float()": model.float,
                 "to(cpu)": lambda: model.to("cpu"), "cpu()": model.cpu,
                 "module.to(cpu, float32)": lambda: model.module.to("cpu", torch.float32)}
        checks: Dict[str, object] = {}
        for name, call in calls.items():
            try:
                checks[name] = "ok" if call() in (model, model.module) else "returned another module"
            except RuntimeError as exc:
                checks[name] = str(exc)
        ids = torch.arange(8)[None] % VOCAB
        checks["logits"] = str(model(input_ids=ids).logits.dtype)
        checks["rotary buffer"] = str(model.module.model.rotary_emb.inv_freq.dtype)
        if precision is None:
            checks.update(_train_both(ctx, model, reference, 2)[0])
        else:  # the compute dtype: a no-op for the parameters; buffers follow as on the unwrapped model
            model.to(torch.bfloat16)
            checks["rotary buffer after to(bfloat16)"] = str(model.module.model.rotary_emb.inv_freq.dtype)
        out[level if precision is None else f"{level} bf16"] = checks
    return out


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the largest magnitude of ``want`` (0.0: bitwise equal)."""
    if torch.equal(got, want):
        return 0.0
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


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
