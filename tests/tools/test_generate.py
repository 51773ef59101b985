"""``tools/generate.py``: what a trained checkpoint says, decoded as HuggingFace decodes it.

- a Llama-shaped model (GQA, SwiGLU, RoPE, RMSNorm, untied) made by transformers -> ``from-hf``
  -> checkpoint (1 rank) -> ``to-hf``: generate.py's greedy tokens, on 4 ranks at TP 2 x DP 2
  ZeRO-3 (the checkpoint resharded by DCP), equal ``generate()``'s of the exported model token
  for token, and the text streamed is their decoding;
- the sampling filters: top-k 1 and a tiny top-p are argmax at any temperature, samples stay
  inside the top-k set, and a seed repeats a sample;
- a DeepSeek-shaped checkpoint (multi-latent attention, MTP, a sigmoid router with expert bias) generates from
  ``--load`` alone: every model flag comes from the checkpoint;
- NullTokenizer: the continuation's ids are printed separated from the prompt's and from
  each other; a prompt it cannot read (words, an id past the vocabulary) is one line, exit status 2,
  before any process group.
"""

import pytest
import torch

from megatron.fsdp_training.tools import generate
from megatron.fsdp_training.tools.checkpoint_tools import hf_convert
from tests.cases.job_runs import generate_in_pool, pretrain


def _hf_llama(path, vocab_size=257):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # initializer_range 0.2: logits far apart, so float rounding never decides an argmax
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(path)


def test_greedy_generation_equals_huggingface_generate(mcore_pool, tmp_path):
    from transformers import AutoModelForCausalLM

    _hf_llama(tmp_path / "made")
    hf_convert.from_hf(str(tmp_path / "made"), str(tmp_path / "ckpt"))
    hf_convert.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "exported"))
    prompt, new = "def f(x):", 24
    got = mcore_pool.run(generate_in_pool, timeout=300, argv=[
        "--load", str(tmp_path / "ckpt"), "--prompt", prompt, "--max-new-tokens", str(new), "--greedy",
        "--no-stop-at-eod", "--tensor-model-parallel-size", "2", "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", "optim_grads_params"])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    prompt_ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        want = hf.generate(prompt_ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           attention_mask=torch.ones_like(prompt_ids), pad_token_id=256)[0, len(prompt):].tolist()
    assert len(want) == new and len(set(want)) > 3  # a sequence, not one token repeated
    assert all(rank["ids"] == want for rank in got), ([rank["ids"] for rank in got], want)
    text = bytes(i for i in want if i < 256).decode("utf-8", errors="replace")
    assert got[0]["text"].startswith(prompt) and text.rstrip("\ufffd") in got[0]["text"]


def test_sampling_filters():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0, 2.8])
    for temperature in (0.5, 1.0, 5.0):
        assert generate.choose_token(logits, temperature, 1, 1.0, torch.Generator().manual_seed(3)) == 1
        assert generate.choose_token(logits, temperature, 0, 1e-6, torch.Generator().manual_seed(3)) == 1
    assert generate.choose_token(logits, 0.0, 0, 1.0, None) == 1
    gen = torch.Generator().manual_seed(0)
    drawn = {generate.choose_token(logits, 5.0, 3, 1.0, gen) for _ in range(200)}
    assert drawn == {1, 2, 4}  # the top 3, each drawn at a high temperature
    gen = torch.Generator().manual_seed(0)
    drawn = {generate.choose_token(logits, 5.0, 0, 0.5, gen) for _ in range(200)}
    assert drawn <= {1, 2, 4} and len(drawn) >= 2  # nucleus of 0.5 at temperature 5: a few leaders
    first = [generate.choose_token(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(9)) for _ in range(3)]
    assert len(set(first)) == 1


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    """Not a model with random weights (the job itself would start from scratch there): one error."""
    from megatron.fsdp_training.checkpointing.files import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint to generate from"):
        generate.run(generate.parse_args(["--load", str(tmp_path / "none"), "--prompt", "x"]))


def test_the_load_line_says_generation_not_fine_tuning():
    """generate.py loads weights only (``--finetune``'s load); the load line names its purpose."""
    import inspect

    from megatron.fsdp_training.checkpointing.compatibility import weights_only_suffix

    assert weights_only_suffix(finetune=False) == ""
    assert weights_only_suffix(finetune=True) == " for fine-tuning"
    assert 'weights_only_purpose = True, "generation"' in inspect.getsource(generate.run)
    assert weights_only_suffix(finetune=True, purpose="generation") == " for generation"


# NullTokenizer --vocab-size 63: ids 0..62 and the end of document 63, the 64 rows of this model
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]


def _null_checkpoint(tmp_path):
    _hf_llama(tmp_path / "made", vocab_size=64)
    hf_convert.from_hf(str(tmp_path / "made"), str(tmp_path / "ckpt"))
    return str(tmp_path / "ckpt")


def test_null_tokenizer_ids_are_printed_separated(mcore_pool, tmp_path):
    got = mcore_pool.run(generate_in_pool, timeout=300, argv=[
        "--load", _null_checkpoint(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "6", "--greedy",
        "--no-stop-at-eod"] + NULL)
    ids = got[0]["ids"]
    assert len(ids) == 6 and got[0]["text"] == "1 2 3 " + " ".join(map(str, ids)) + "\n", got[0]


@pytest.mark.parametrize("prompt, expected", [
    ("def f(x):", "NullTokenizer: the text must be integer ids"),
    ("1 2 999", "NullTokenizer: token id 999 is outside [0, 64)"),
])
def test_a_prompt_the_tokenizer_cannot_read_is_one_line(tmp_path, capsys, prompt, expected):
    import torch.distributed as dist

    with pytest.raises(SystemExit) as status:
        generate.main(["--load", _null_checkpoint(tmp_path), "--prompt", prompt] + NULL)
    out = capsys.readouterr().out.strip().splitlines()
    assert status.value.code == 2 and len(out) == 1 and not dist.is_initialized(), out
    assert out[0].startswith(f"error: --prompt {prompt!r}: {expected}") and "e.g. --prompt '1 2 3'" in out[0], out


DEEPSEEK_SHAPED = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--seed", "7",
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank",
    "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--mtp-num-layers", "1",
    "--num-experts", "4", "--moe-layer-freq", "[0]*1+[1]*1", "--moe-ffn-hidden-size", "32", "--moe-router-topk",
    "2", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
] + NULL


def test_a_deepseek_shaped_checkpoint_generates_from_load_alone(mcore_pool, tmp_path):
    """Without the checkpoint's MLA / MTP / router flags the job would build another model and the load would
    refuse it (the compatibility check names the first differing flag): generation reads them all."""
    pretrain(4, DEEPSEEK_SHAPED + ["--mock-data", "--save", str(tmp_path / "ckpt")])
    got = mcore_pool.run(generate_in_pool, timeout=300, argv=[
        "--load", str(tmp_path / "ckpt"), "--prompt", "1 2 3", "--max-new-tokens", "4", "--greedy",
        "--no-stop-at-eod"])
    assert all(len(rank["ids"]) == 4 and rank["ids"] == got[0]["ids"] for rank in got), got
    assert all(0 <= i < 63 for i in got[0]["ids"])
