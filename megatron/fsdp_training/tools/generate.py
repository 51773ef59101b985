"""Prompt a checkpoint this project wrote and print what the model says, token by token.

    megatron-fsdp-generate --load CKPT_DIR --prompt "def main(" [--max-new-tokens 64]
        [--greedy | --temperature 0.8 --top-k 50 --top-p 0.9] [--seed 1234]
    torchrun --nproc_per_node 2 -m megatron.fsdp_training.tools.generate --load CKPT_DIR \\
        --tensor-model-parallel-size 2 ...

The model is built and loaded by the training job itself (``megatron.fsdp_training.job_setup.setup``
and ``checkpointing.save_load.load_checkpoint``), so every checkpoint the job can resume from
loads here, at any layout: DCP reshards it to this launch's TP / DP / ZeRO level. The job's
flags are accepted as they are; the model's shape and tokenizer flags default to the values
stored in the checkpoint's ``common.json``, so ``--load`` and a prompt are enough. The layout
flags (``--tensor-model-parallel-size``, ``--data-parallel-sharding-strategy``, ...) are this
launch's, not the checkpoint's: by default one process holds the whole model.

Decoding recomputes the whole window at every step (no KV cache: this is a way to see what a
trained model says, not a server). Every rank runs the same forward (ZeRO-3 gathers the
weights); rank 0 samples, broadcasts the token and prints it as soon as it is chosen.
``--temperature 0`` is ``--greedy``: argmax, which equals HuggingFace ``generate()``'s greedy
decoding of the exported model (``convert.py to-hf``). Sampling follows HF's order:
temperature, then top-k, then top-p. Generation stops after ``--max-new-tokens`` or at the
tokenizer's end-of-document id.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from typing import Callable, List, Optional

import torch

from megatron.fsdp.commands import GENERATE, set_command_defaults

# Job arguments taken from the checkpoint when the command line does not give them: every flag of the parser's
# model and mixture-of-experts groups (the shape, multi-latent attention, MTP, the router) except the experts'
# parallel layout, and the tokenizer (the parallel layout, data, schedule and checkpoint flags stay this launch's).
_SHAPE_GROUPS = ("model", "mixture of experts")
_LAYOUT_PREFIX = "expert_"  # --expert-model-parallel-size, --expert-tensor-parallel-size, the expert sharding
# How this launch moves tokens to experts, not what the model is (the kernels have a group of their own).
_MOE_DISPATCH = ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_permute_fusion")
_TOKENIZER = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
              "make_vocab_size_divisible_by")


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(f"generation ({GENERATE})")
    g.add_argument("--prompt", default="", help="text the model continues (default: none, start from nothing)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens whose "
                   "probabilities add up to p (nucleus sampling; 1.0: all)")
    g.add_argument("--no-stop-at-eod", dest="stop_at_eod", action="store_false",
                   help="keep generating past the tokenizer's end-of-document id")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How many tokens and how each is chosen: the generation flags of the same names (``--greedy`` is
    ``temperature`` 0, ``stop_at_eod`` is not ``--no-stop-at-eod``) and the job's ``--seed`` for sampling."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_at_eod: bool


# ------------------------------------------------------------------ sampling
def choose_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 generator: Optional[torch.Generator]) -> int:
    """The next id from one row of logits: argmax at temperature 0, else a sample (HF's filter order)."""
    logits = logits.float()
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= top_p  # keep the token that crosses p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def _full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The last position's logits over the whole (padded) vocabulary, on every rank of the TP group."""
    from megatron.core import tensor_parallel

    seq = tokens.shape[1]
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
    with _main_head_only(model):
        logits = model(tokens, positions, mask)  # [1, seq, vocab / TP]
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits[:, -1:, :].contiguous())[0, -1]


@contextlib.contextmanager
def _main_head_only(model):
    """A model with multi-token prediction layers, run for its next token only: the MTP layers predict further
    tokens for their training loss, and Megatron-Core's GPTModel computes them (needing labels) whenever it has
    them outside its own inference context. Switched off for the call, as they are when no MTP was built."""
    gpt = next((m for m in model.modules() if hasattr(m, "mtp_process")), None)
    if gpt is None or not getattr(gpt.config, "mtp_num_layers", None):
        yield
        return
    saved = gpt.mtp_process, gpt.config.mtp_num_layers
    gpt.mtp_process, gpt.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        gpt.mtp_process, gpt.config.mtp_num_layers = saved


@torch.no_grad()
def generate(model, prompt_ids: List[int], config: GenerationConfig, *, vocab_size: int, window: int,
             eod: Optional[int], device: torch.device, on_token: Callable[[int], None] = lambda token: None) -> List[int]:
    """Extend ``prompt_ids`` by up to ``config.max_new_tokens`` ids (collective: every rank calls it).

    ``vocab_size``: the tokenizer's size (padding rows of the output layer are never chosen);
    ``window``: the longest context the model takes (the last ``window`` ids are fed);
    ``eod``: the id that ends generation (None: none does).
    """
    import torch.distributed as dist

    for chunk in model:
        chunk.eval()
    generator = torch.Generator().manual_seed(config.seed)
    ids = list(prompt_ids) or ([eod] if eod is not None else [0])
    start = len(ids)
    for _ in range(config.max_new_tokens):
        tokens = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
        logits = _full_logits(model[0], tokens)[:vocab_size].cpu()
        token = torch.tensor([choose_token(logits, config.temperature, config.top_k, config.top_p, generator)],
                             dtype=torch.long)
        dist.broadcast(token.to(device), src=0)  # one decision for every rank
        ids.append(int(token))
        on_token(ids[-1])
        if eod is not None and ids[-1] == eod:
            break
    return ids[start:] if prompt_ids else ids[1:]


class Stream:
    """Prints decoded text as tokens arrive; holds back an incomplete UTF-8 character (``\\ufffd``).

    The continuation is decoded after the prompt's ids (``context``), as part of one text, so the
    tokenizer puts what separates them: NullTokenizer's space between ids ("1 2 3" + "3 3" printed
    "1 2 33 3" when each was decoded alone), a word boundary of a SentencePiece model. Where the
    prompt's own decoding is not a prefix of the whole (a character cut at the prompt's end), the
    continuation is decoded alone."""

    def __init__(self, tokenizer, out=None, context=()):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], ""
        self.context = list(context)
        prefix = tokenizer.detokenize(self.context) if self.context else ""
        self.prefix = None if prefix.endswith("\ufffd") else prefix

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        whole = self.tokenizer.detokenize(self.context + self.ids)
        if whole.endswith("\ufffd"):
            return
        text = whole[len(self.prefix):] if self.prefix is not None and whole.startswith(self.prefix) else \
            self.tokenizer.detokenize(self.ids)
        self.out.write(text[len(self.shown):])
        self.out.flush()
        self.shown = text


def tokenize_prompt(prompt: str, tokenizer_config) -> List[int]:
    """``--prompt``'s ids, read before any process group: text the tokenizer cannot read (NullTokenizer's
    words, an id past its vocabulary) is one line naming the fix, not a traceback after the model loads.
    ``tokenizer_config``: the job's ``TokenizerConfig``."""
    from megatron.fsdp_training.data import datasets as data
    from megatron.fsdp_training.errors import ArgumentError

    if not prompt:
        return []
    tokenizer = data.build_tokenizer(tokenizer_config)
    try:
        return tokenizer.tokenize(prompt)
    except ValueError as exc:
        hint = ""
        if tokenizer_config.tokenizer_type == "NullTokenizer":
            hint = (f"; NullTokenizer reads whitespace-separated integer ids in [0, {tokenizer.vocab_size}) "
                    f"(--vocab-size {tokenizer.vocab_size - 1}, and {tokenizer.eod} the end of document), "
                    "e.g. --prompt '1 2 3'")
        raise ArgumentError(f"--prompt {prompt!r}: {exc}{hint}") from None


# ------------------------------------------------------------------ the command
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The job's parser plus the generation flags, with the checkpoint's model and tokenizer as defaults."""
    from megatron.fsdp_training.arguments import build_parser

    parser = build_parser()
    parser.description = __doc__.split("\n")[0]
    add_generation_args(parser)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--load")
    pre.add_argument("--ckpt-step", type=int)
    known, _ = pre.parse_known_args(argv)
    if known.load:
        parser.set_defaults(**_saved_defaults(parser, known.load, known.ckpt_step))
    args = parser.parse_args(argv)
    if not args.load:
        parser.error("--load CKPT_DIR is required: the checkpoint to generate from")
    if args.greedy:
        args.temperature = 0.0
    for name, ok in (("--max-new-tokens", args.max_new_tokens >= 0), ("--temperature", args.temperature >= 0),
                     ("--top-k", args.top_k >= 0), ("--top-p", 0 < args.top_p <= 1)):
        if not ok:
            parser.error(f"{name} out of range (max-new-tokens >= 0, temperature >= 0, top-k >= 0, 0 < top-p <= 1)")
    # Nothing is trained: no data, no save, the optimizer and RNG states are not read.
    args.mock_data, args.data_path, args.save = True, None, None
    args.no_load_optim = args.no_load_rng = True
    args.micro_batch_size, args.global_batch_size = 1, None
    args.eval_iters = 0
    return args


def shape_dests(parser: argparse.ArgumentParser) -> tuple:
    """The destinations of the parser's model and mixture-of-experts flags, less the experts' parallel layout and
    this launch's token dispatch: what a checkpoint's model is, read from the groups the flags are declared in, so a new
    model flag is taken from the checkpoint without a second list."""
    return tuple(action.dest for group in parser._action_groups if group.title in _SHAPE_GROUPS
                 for action in group._group_actions
                 if not action.dest.startswith(_LAYOUT_PREFIX) and action.dest not in _MOE_DISPATCH)


def _saved_defaults(parser: argparse.ArgumentParser, load: str, step: Optional[int]) -> dict:
    """The checkpoint's stored shape and tokenizer arguments, as parser defaults (none when unreadable)."""
    import json
    from pathlib import Path

    from megatron.fsdp_training.checkpointing import files

    from megatron.fsdp_training.checkpointing import torch_dist

    root = Path(load)
    iteration = step if step is not None else files.read_tracker(root) if root.is_dir() else None
    directory = files.checkpoint_dir(root, iteration) if iteration is not None else None
    if directory is not None and torch_dist.is_torch_dist(directory):  # the baseline's: its args, pickled
        common = {"args": vars(torch_dist.read_common(directory)["args"]), "format": torch_dist.FORMAT}
    elif directory is not None and (directory / files.COMMON).is_file():
        common = json.loads((directory / files.COMMON).read_text())
    else:
        return {}  # the job's own loader says what is wrong with this directory
    saved = dict(common.get("args", {}))
    defaults = {k: saved[k] for k in shape_dests(parser) + _TOKENIZER if k in saved}
    defaults["use_megatron_fsdp"] = common.get("format") == "fsdp_dtensor"
    model_args = common.get("model_args", {})
    if "make_vocab_size_divisible_by" not in saved and model_args.get("padded_vocab_size") and \
            model_args.get("padded_vocab_size") == model_args.get("true_vocab_size"):
        defaults["make_vocab_size_divisible_by"] = 1  # a converted model: its rows, unpadded
    if "seq_length" not in saved and saved.get("max_position_embeddings"):
        defaults["seq_length"] = saved["max_position_embeddings"]
    return defaults


def run(args: argparse.Namespace, out=None) -> List[int]:
    """Entry point of the command: the job's ``setup`` and weights-only load take the namespace (``parse_args``'s).

    Build, load, generate; returns the generated ids (every rank). ``out``: where rank 0 streams the text."""
    import torch.distributed as dist

    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training.checkpointing.files import TRACKER, CheckpointError
    from megatron.fsdp_training.checkpointing.paths import find_checkpoint
    from megatron.fsdp_training.checkpointing.save_load import load_checkpoint
    from megatron.fsdp_training.data.data_config import TokenizerConfig
    from megatron.fsdp_training.errors import ArgumentError
    from megatron.fsdp_training.logs.lines import print_rank_0
    from megatron.fsdp_training.job_setup import setup

    for flag, value in (("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
                        ("--context-parallel-size", args.context_parallel_size)):
        if value != 1:
            raise ArgumentError(f"{flag} {value}: generation runs the whole model on each rank's stage; use "
                                f"{flag} 1 (the checkpoint loads at any layout: DCP reshards it)")
    # without a checkpoint the job's load would start from scratch
    if args.ckpt_format != "torch_dist" and find_checkpoint(args.load, args.ckpt_step) is None:
        raise CheckpointError(f"{args.load}: no checkpoint to generate from (no {TRACKER}): pass the --save "
                              "directory of a run that saved, or --ckpt-step N for one of its iter_* directories")
    prompt_ids = tokenize_prompt(args.prompt, TokenizerConfig.from_args(args))
    generation = GenerationConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig)})
    device, tokenizer, model, optimizer, scheduler = setup(args)
    # Weights only (Megatron-LM's --finetune load): generation resumes no optimizer, RNG, schedule or
    # iteration, so the checks that guard a resumed run (--train-iters past the checkpoint's) do not apply.
    args.finetune, args.weights_only_purpose = True, "generation"
    load_checkpoint(CheckpointConfig.from_args(args), model, optimizer, scheduler)
    window = args.max_position_embeddings
    if len(prompt_ids) > window:
        print_rank_0(f" prompt of {len(prompt_ids)} tokens: only its last {window} (the model's window) are read")
    stream = Stream(tokenizer, out, context=prompt_ids) if dist.get_rank() == 0 else (lambda token: None)
    if dist.get_rank() == 0:
        (out or sys.stdout).write(args.prompt)
    ids = generate(model, prompt_ids, generation, vocab_size=tokenizer.vocab_size, window=window,
                   eod=tokenizer.eod if generation.stop_at_eod else None, device=device, on_token=stream)
    if dist.get_rank() == 0:
        (out or sys.stdout).write("\n")
        ended = " (end of document)" if ids and generation.stop_at_eod and ids[-1] == tokenizer.eod else ""
        print_rank_0(f" generated {len(ids)} tokens{ended}")
    return ids


def main(argv: Optional[List[str]] = None) -> None:
    set_command_defaults()
    from megatron.fsdp_training.training import run_entry_point

    run_entry_point(lambda command_line: run(parse_args(command_line)), argv)


if __name__ == "__main__":
    main()
