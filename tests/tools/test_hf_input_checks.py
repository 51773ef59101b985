"""What ``convert.py from-hf`` checks before it writes (``megatron/fsdp_training/tools/checkpoint_tools/hf_checks.py``).

- Sliding windows, one tiny model per family made by transformers: each config is run by transformers
  itself, which decides whether the window takes effect (its logits against the same weights with full
  attention, on a sequence of ``max_position_embeddings``). Where it does, from-hf refuses with one line
  naming the field and the fix, and writes nothing; where it does not (no ``use_sliding_window``,
  ``max_window_layers`` past the last layer, a window no shorter than the model's positions, Llama's
  ignored field), from-hf converts and the job's model of the printed flags gives transformers' logits.
- ``tie_word_embeddings`` true with a different ``lm_head.weight`` in the files: transformers keeps both,
  and so does the conversion (untied, said in one line), logits equal; an equal copy stays tied.
- A config that does not describe its tensors, or that transformers would read differently (a missing
  field, a wrong type, GQA heads that do not divide, a vocabulary the tensors disagree with), and a
  truncated safetensors file: one line, nothing written; a conversion failing while it writes leaves the
  destination as it was.
"""

import json
import os

import pytest
import torch

from tests.cases.hf import megatron_logits_of_each
from megatron.fsdp_training.tools.checkpoint_tools import convert, hf_convert, hf_io, hf_tokenizer

SIZE = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=32, max_position_embeddings=16, rms_norm_eps=1e-5)
EXTRA = {"qwen2_moe": dict(moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=2,
                           num_experts_per_tok=1),
         "mixtral": dict(num_local_experts=2, num_experts_per_tok=2),
         "qwen3": dict(head_dim=8),
         "qwen3_moe": dict(moe_intermediate_size=8, num_experts=2, num_experts_per_tok=1, head_dim=8)}
TOKENS = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(0))  # max_position_embeddings long
# (family, config.json changes, drop layer_types as the Hub's pre-transformers-5 configs lack it, transformers'
#  verdict: does the window change its outputs?)
WINDOWS = [
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), True, True),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 2), False, True),
    ("qwen2", dict(use_sliding_window=False, sliding_window=4, max_window_layers=0), True, False),  # Qwen2.5's
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), True, False),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), True, False),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4), True, True),
    ("qwen2_moe", dict(use_sliding_window=False, sliding_window=4), True, False),
    ("mixtral", dict(sliding_window=4), False, True),
    ("mixtral", dict(sliding_window=None), False, False),
    ("mixtral", dict(sliding_window=16), False, False),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), True, True),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), True, False),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4), False, True),
    ("qwen3_moe", dict(use_sliding_window=False, sliding_window=4), False, False),
    ("llama", dict(use_sliding_window=True, sliding_window=4), False, False),  # transformers' Llama has none
]
FIX = {"mixtral": '"sliding_window": null'}


def _made(family, **overrides):
    """A tiny transformers model of ``family`` (full attention: its config class's defaults)."""
    from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig)

    config = {"qwen2": Qwen2Config, "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig, "qwen3": Qwen3Config,
              "qwen3_moe": Qwen3MoeConfig, "llama": LlamaConfig}[family]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(**{**SIZE, **EXTRA.get(family, {}), **overrides})).eval()


def _saved_with(model, directory, changes, drop_layer_types=False):
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    if drop_layer_types:
        config.pop("layer_types", None)
    (directory / "config.json").write_text(json.dumps(config))


def _logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def _refused(argv):
    """``convert.py argv`` stops with one line; returns it."""
    with pytest.raises(SystemExit) as exc:
        convert.main(argv)
    message = str(exc.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def _megatron_case(hf_dir, ckpt, arch, tmp_path):
    model_file = tmp_path / f"{ckpt.name}.pt"
    convert.to_torch(str(ckpt), str(model_file), model_only=True)
    argv = hf_tokenizer.training_flags(arch, str(hf_dir)) + ["--mock-data", "--micro-batch-size", "1"]
    return dict(argv=argv, model_file=str(model_file), tokens=TOKENS)


def _megatron_equals(mcore_pool, cases, want):
    got = mcore_pool.run(megatron_logits_of_each, timeout=300, cases=cases)[0]
    for name, result, logits in zip(want, got, want.values()):
        assert result["missing"] == [] and result["unexpected"] == [], (name, result)
        diff = (result["logits"] - logits).abs().max().item()
        assert diff <= 1e-5, (name, diff)


def test_sliding_windows_convert_only_where_transformers_ignores_them(mcore_pool, tmp_path):
    from transformers import AutoModelForCausalLM

    cases, want = [], {}
    for k, (family, changes, drop_layer_types, active) in enumerate(WINDOWS):
        name = f"{k}-{family}"
        base = _made(family)
        hf_dir, ckpt = tmp_path / name, tmp_path / f"{name}-ckpt"
        _saved_with(base, hf_dir, changes, drop_layer_types)
        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
        diff = (_logits(hf) - _logits(base)).abs().max().item()
        assert (diff > 1e-4) == active, (name, changes, diff)  # transformers' own verdict
        if active:
            message = _refused(["from-hf", str(hf_dir), str(ckpt)])
            window = changes["sliding_window"]
            assert "sliding window" in message and f"differ from position {window} on" in message, message
            assert FIX.get(family, '"use_sliding_window": false') in message, message
            assert not ckpt.exists()
        else:
            _, arch = hf_convert.from_hf(str(hf_dir), str(ckpt))
            if not any(n.endswith("-" + family) for n in want):  # the job's model: one per family
                cases.append(_megatron_case(hf_dir, ckpt, arch, tmp_path))
                want[name] = _logits(hf)
    # layer_types naming sliding layers without a window: transformers cannot run it; refused in one line
    broken = dict(use_sliding_window=False, layer_types=["sliding_attention"] * 2)
    _saved_with(_made("qwen2"), tmp_path / "broken", broken)
    with pytest.raises(TypeError):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "broken"))(TOKENS)
    assert "gives them no window" in _refused(["from-hf", str(tmp_path / "broken"), str(tmp_path / "broken-ckpt")])
    _megatron_equals(mcore_pool, cases, want)


def test_a_tie_the_tensors_contradict_converts_as_transformers_loads_it(mcore_pool, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    untied = _made("llama", tie_word_embeddings=False)
    _saved_with(untied, tmp_path / "contradicted", dict(tie_word_embeddings=True))  # both matrices kept, differing
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "contradicted")).eval()
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()  # transformers did not tie
    convert.main(["from-hf", str(tmp_path / "contradicted"), str(tmp_path / "untied-ckpt")])
    out = capsys.readouterr().out
    assert out.count("lm_head.weight differs from model.embed_tokens.weight") == 1, out
    assert "converted untied (--untie-embeddings-and-output-weights)" in out
    _, arch = hf_convert.from_hf(str(tmp_path / "contradicted"), str(tmp_path / "again"))
    assert not arch.tied and "--untie-embeddings-and-output-weights" in arch.megatron_flags()
    # an lm_head equal to the embedding (a tied model's copy in the files) stays tied
    tied = _made("llama", tie_word_embeddings=True)
    tied.save_pretrained(tmp_path / "copy")
    tensors = load_file(str(tmp_path / "copy" / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "copy" / "model.safetensors"), metadata={"format": "pt"})
    report, copy_arch = hf_convert.from_hf(str(tmp_path / "copy"), str(tmp_path / "copy-ckpt"))
    assert copy_arch.tied and report.note == ""
    _megatron_equals(mcore_pool, [_megatron_case(tmp_path / "contradicted", tmp_path / "untied-ckpt", arch, tmp_path),
                                  _megatron_case(tmp_path / "copy", tmp_path / "copy-ckpt", copy_arch, tmp_path)],
                     {"untied": _logits(hf), "tied": _logits(tied)})


@pytest.mark.parametrize("family, change, expected", [
    ("llama", dict(num_attention_heads=None), 'config.json has no "num_attention_heads", which a llama model needs'),
    ("llama", dict(num_attention_heads=4, num_key_value_heads=3),
     "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ("llama", dict(hidden_size="16"), 'config.json: "hidden_size" is "16" (str), but it must be a positive integer'),
    ("llama", dict(tie_word_embeddings="false"),
     '"tie_word_embeddings" is "false" (str), but it must be true or false'),
    ("llama", dict(vocab_size=40), "model.embed_tokens.weight [32, 16] do not fit config.json: its sizes (vocab_size, "
                          "hidden_size) make embedding.word_embeddings.weight [40 x 16], these tensors [32 x 16]"),
    ("mixtral", dict(num_experts_per_tok=1), "Megatron-Core builds top-1 routing only with --moe-router-pre-softmax"),
])
def test_a_config_that_does_not_describe_its_tensors_is_one_line(tmp_path, family, change, expected):
    model = _made(family)
    _saved_with(model, tmp_path / "hf", {k: v for k, v in change.items() if v is not None})
    if None in change.values():
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in change}))
    assert expected in _refused(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")])
    assert not (tmp_path / "ckpt").exists()


def test_a_truncated_file_or_a_failed_write_leaves_the_destination_as_it_was(tmp_path, monkeypatch):
    _made("llama").save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 100)
    message = _refused(["from-hf", str(tmp_path / "hf"), str(tmp_path / "new" / "ckpt")])
    assert f"{weights} is truncated: its header describes {size} bytes, the file has {size - 100}" in message
    assert not (tmp_path / "new").exists()
    os.truncate(weights, 4)
    assert "is not a complete safetensors file" in _refused(["from-hf", str(tmp_path / "hf"), str(tmp_path / "c")])
    # a failure half-way through writing (a full disk): the temporary and the directories made for it go
    _made("llama").save_pretrained(tmp_path / "hf")
    write = hf_io.write_dcp_lazily

    def full_disk(directory, shapes, produce):
        write(directory, dict(list(shapes.items())[:1]), produce)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_io, "write_dcp_lazily", full_disk)
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    for destination, overwrite in ((tmp_path / "fresh" / "ckpt", []), (tmp_path / "kept", ["--overwrite"])):
        assert "No space left on device" in _refused(["from-hf", str(tmp_path / "hf"), str(destination)] + overwrite)
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["notes.txt"]
