"""``--help`` that shows every argument's meaning and default, for pretrain_gpt.py's parser.

A newcomer reads ``--help`` to learn that ``--use-megatron-fsdp`` alone is ZeRO-3
(``optim_grads_params``, as in Megatron-LM) and what each parallelism, recompute, optimizer and data flag
does; docs/training.md's argument tables are generated from the same parser
(tools/regenerate_docs.py), so the two say the same.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every default; a help text that already explains its default keeps its own words."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return (text + " (default: off)").strip()  # a flag is off unless given
        return super()._get_help_string(action).strip()


# What the arguments without a help text of their own mean (applied after the parser is
# built, so each group's owner keeps its add_argument lines as they are).
_MEANINGS = {
    "--num-layers": "transformer layers", "--hidden-size": "model width",
    "--num-attention-heads": "attention heads", "--seq-length": "tokens per sample",
    "--init-method-std": "standard deviation of the normal initialisation of the weights",
    "--transformer-impl": "layer implementation (transformer_engine without Transformer Engine installed: local, said at start-up)",
    "--untie-embeddings-and-output-weights": "a separate output layer instead of the input embedding's transpose",
    "--recompute-granularity": "activation recompute: full (whole layers) or selective (core attention)",
    "--recompute-method": "with --recompute-granularity full: uniform (every N layers) or block (the first N)",
    "--recompute-num-layers": "N for --recompute-method",
    "--moe-router-topk": "experts per token", "--moe-token-dispatcher-type": "how tokens reach their experts",
    "--expert-model-parallel-size": "EP: ranks the experts of a layer are split across",
    "--moe-grouped-gemm": "one grouped GEMM for the local experts",
    "--moe-aux-loss-coeff": "weight of the router's load-balancing loss (logged when > 0)",
    "--moe-router-load-balancing-type": "the router's balancing loss",
    "--micro-batch-size": "samples per micro-batch per data-parallel rank",
    "--train-iters": "optimizer steps", "--seed": "random seed (+100 x pipeline rank)",
    "--bf16": "bf16 compute, fp32 main weights", "--fp16": "fp16 (rejected: needs loss scaling)",
    "--optimizer": "adam (decoupled weight decay, as torch AdamW) or sgd", "--lr": "peak learning rate",
    "--min-lr": "learning rate at the end of the decay", "--lr-decay-style": "learning-rate schedule after warm-up",
    "--lr-warmup-iters": "linear warm-up from 0", "--weight-decay": "decoupled weight decay",
    "--clip-grad": "global gradient-norm clipping", "--adam-beta1": "Adam beta1", "--adam-beta2": "Adam beta2",
    "--adam-eps": "Adam epsilon", "--sgd-momentum": "momentum with --optimizer sgd",
    "--tensor-model-parallel-size": "TP size", "--pipeline-model-parallel-size": "PP size",
    "--num-layers-per-virtual-pipeline-stage": "layers per virtual stage (VPP; needs PP > 1)",
    "--context-parallel-size": "CP size (sequence split across ranks)",
    "--sequence-parallel": "sequence parallelism within TP (needed for MoE with TP > 1)",
    "--use-distributed-optimizer": "without --use-megatron-fsdp: Megatron-Core's DistributedOptimizer (ZeRO-1)",
    "--mock-data": "Megatron-Core's mock GPT dataset instead of --data-path",
    "--data-path": "indexed dataset prefix(es) from tools/preprocess_data.py, optionally weighted: W1 P1 W2 P2",
    "--split": "train,validation,test weights of the documents of each --data-path",
    "--tokenizer-model": "HuggingFaceTokenizer: a local directory", "--vocab-file": "GPT2BPETokenizer: vocab.json",
    "--merge-file": "GPT2BPETokenizer: merges.txt", "--vocab-size": "NullTokenizer: ids below it; others: pad to it",
    "--make-vocab-size-divisible-by": "pad the vocabulary to a multiple of this x TP",
    "--num-workers": "data-loader worker processes; the job reads samples in the training process (N > 0 is said "
                     "at start-up)",
    "--log-interval": "iterations per log line (times and losses averaged over them)",
    "--eval-interval": "iterations between validations (default: --train-iters, i.e. once at the end)",
    "--eval-iters": "validation batches per validation (0: no validation, no validation split built)",
    "--tensorboard-dir": "write scalars here (needs tensorboard)",
    "--muon-momentum": "Muon's momentum (with --optimizer muon)",
    "--muon-nesterov": "Nesterov momentum in Muon (--muon-use-nesterov: Megatron-LM 0.16's spelling)",
    "--muon-coefficient-type": "Newton-Schulz coefficients, one triple per iteration (simple: torch.optim.Muon's "
                               "single triple)",
    "--muon-scalar-optimizer": "optimizer of the embedding, output layer, norms and biases under --optimizer muon "
                               "(lion is refused: not implemented)",
    "--muon-num-ns-steps": "Newton-Schulz iterations that orthogonalise each update",
    "--muon-scale-mode": "how the orthogonalised update is scaled to the matrix's shape",
    "--muon-extra-scale-factor": "a further factor on Muon's update",
    "--muon-tp-mode": "under TP: orthogonalise each rank's block (blockwise) or the gathered matrix (duplicated)",
}


def show_every_default(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every argument a help text, so that ``--help`` shows its meaning and default.

    argparse prints no help line (and so no default) for an argument without one.
    """
    for action in parser._actions:
        if action.help is None and action.option_strings:
            action.help = _MEANINGS.get(action.option_strings[0], "")
        if not action.help:
            action.help = "(default: off)" if isinstance(
                action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) else "(default: %(default)s)"
    return parser
