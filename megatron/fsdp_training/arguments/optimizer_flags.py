"""The optimizer's and the learning-rate schedule's flags: Adam, SGD, Muon, the schedule in iterations or in
samples, warm-up, and the decoupled learning rate of the embedding and output layer.

Megatron-LM's names, defaults and meanings. Its ``OptimizerParamScheduler`` counts samples: lengths
in iterations are multiplied by the global batch (``batch_rampup.ScheduleLengths``, outside this package);
every group warms up from ``--lr-warmup-init`` to its own maximum (``--lr``, or ``--decoupled-lr`` for
the input embedding and output layer). Which of iterations or samples a run counts in is
``training.py``'s rule (the training length decides). docs/arguments.md ("Arguments") and
docs/muon.md say what each does here.
"""

from __future__ import annotations

import argparse

from megatron.fsdp.optim.newton_schulz import COEFFICIENT_SETS

from ..errors import refuse


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam", "sgd", "muon"], default="adam",
                   help="muon: Muon for 2-D weights, Adam for the rest (needs --use-megatron-fsdp)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="cosine", help="learning-rate schedule after warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: train iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up from 0")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="samples over which the learning rate decays (default: --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="samples of linear warm-up")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate the warm-up starts from (every group warms up to its own maximum)")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="learning rate of the input embedding and output layer (their own parameter groups)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate of the input embedding and output layer (default: --min-lr)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clipping")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="momentum with --optimizer sgd")
    g.add_argument("--muon-momentum", type=float, default=0.9, help="Muon's momentum (with --optimizer muon)")
    g.add_argument("--muon-nesterov", "--muon-use-nesterov", dest="muon_use_nesterov", action="store_true",
                   help="Nesterov momentum in Muon (--muon-use-nesterov: Megatron-LM 0.16's spelling)")
    g.add_argument("--muon-num-ns-steps", type=int, default=5,
                   help="Newton-Schulz iterations that orthogonalise each update")
    g.add_argument("--muon-scale-mode", choices=["spectral", "shape_scaling", "unit_rms_norm"], default="spectral",
                   help="how the orthogonalised update is scaled to the matrix's shape")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0, help="a further factor on Muon's update")
    g.add_argument("--muon-tp-mode", choices=["blockwise", "duplicated"], default="blockwise",
                   help="under TP: orthogonalise each rank's block (blockwise) or the gathered matrix (duplicated)")
    g.add_argument("--muon-coefficient-type", choices=list(COEFFICIENT_SETS), default="quintic",
                   help="Newton-Schulz coefficients, one triple per iteration (simple: torch.optim.Muon's single "
                        "triple)")
    g.add_argument("--muon-scalar-optimizer", choices=["adam", "lion"], default="adam",
                   help="optimizer of the embedding, output layer, norms and biases under --optimizer muon (lion is "
                        "refused: not implemented)")



# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def validate_muon(args: argparse.Namespace) -> None:
    if args.optimizer != "muon":
        return
    if args.fp16:
        refuse("--optimizer muon with --fp16 is not supported (as in Megatron-LM): use --bf16")
    if not args.use_megatron_fsdp:
        refuse("--optimizer muon needs --use-megatron-fsdp: Megatron-Core 0.16.1's own Muon needs the "
              "emerging_optimizers package (not installable here) and refuses --use-distributed-optimizer")
    if args.muon_scalar_optimizer != "adam":
        refuse(f"--muon-scalar-optimizer {args.muon_scalar_optimizer} is not implemented: Adam (the --adam-* flags) "
              "steps the embedding, output layer, norms and biases; use --muon-scalar-optimizer adam")
    if args.muon_num_ns_steps < 1:
        refuse(f"--muon-num-ns-steps {args.muon_num_ns_steps} must be at least 1")
    if not 0.0 <= args.muon_momentum < 1.0:
        refuse(f"--muon-momentum {args.muon_momentum} must be in [0, 1)")


def validate_learning_rate(args: argparse.Namespace) -> None:
    """The decay length (default: the training length), the warm-up, and the scheduler's own assertions,
    said before start-up (for the decoupled group too)."""
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_fraction is not None:  # Megatron-LM's: warm-up iterations = fraction x --lr-decay-iters
        if args.lr_warmup_iters:
            refuse("--lr-warmup-fraction and --lr-warmup-iters both set the warm-up; give one of them")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            refuse(f"--lr-warmup-fraction={args.lr_warmup_fraction} must be in [0, 1)")
    _check_learning_rates(args)
    if args.lr_warmup_iters >= args.lr_decay_iters:
        refuse(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters (default --train-iters) "
              f"{args.lr_decay_iters}")


def _check_learning_rates(args: argparse.Namespace) -> None:
    if args.lr_warmup_init > args.lr:
        refuse(f"--lr-warmup-init {args.lr_warmup_init} is above --lr {args.lr}")
    if args.decoupled_lr is None:
        if args.decoupled_min_lr is not None:
            refuse("--decoupled-min-lr needs --decoupled-lr (Megatron-LM ignores it alone)")
        return
    low = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
    if not 0.0 <= low <= args.decoupled_lr:
        refuse(f"--decoupled-min-lr (default --min-lr) {low} must be in [0, --decoupled-lr {args.decoupled_lr}]")
    if args.lr_warmup_init > args.decoupled_lr:
        refuse(f"--lr-warmup-init {args.lr_warmup_init} is above --decoupled-lr {args.decoupled_lr}")
