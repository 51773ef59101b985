"""The one start-up line of substituted kernels and backends (megatron/fsdp_training/arguments/substitutions.py)."""

import argparse

from megatron.fsdp_training.arguments.substitutions import Substitution, substitution_line, substitutions


def _flash(args):
    return [Substitution("--use-flash-attn", "PyTorch SDPA", "flash-attn not installed")] if args.use_flash_attn else []


def _ub(args):
    return [Substitution("--use-nccl-ub", "no user buffers", "gloo has no NCCL")] if args.use_nccl_ub else []


def test_one_line_in_the_providers_order_and_none_when_nothing_is_substituted():
    args = argparse.Namespace(use_flash_attn=True, use_nccl_ub=True)
    assert [s.flag for s in substitutions(args, (_ub, _flash))] == ["--use-nccl-ub", "--use-flash-attn"]
    line = substitution_line(args, (_flash, _ub))
    assert line == ("> substituted on this machine: --use-flash-attn -> PyTorch SDPA (flash-attn not installed); "
                    "--use-nccl-ub -> no user buffers (gloo has no NCCL)")
    assert "\n" not in line
    assert substitution_line(argparse.Namespace(use_flash_attn=False, use_nccl_ub=False), (_flash, _ub)) == ""
