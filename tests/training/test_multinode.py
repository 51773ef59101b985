"""Megatron-LM's multi-node launch: ``torchrun --nnodes 2 --node-rank k --master-addr --master-port
--nproc-per-node 2`` started twice (two "nodes" on this machine, by ``examples/sbatch_pretrain.sh`` and an
srun stand-in) is one 4-rank job, bitwise the one-node run; under HSDP (``--num-distributed-optimizer-instances 2``) the shard axis lies inside a node and the
replica axis across nodes."""

from __future__ import annotations

import os
import subprocess

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron.fsdp_training.testing.job import LINE, ROOT
from megatron.fsdp_training.testing.pools import pool_of
from megatron.fsdp_training.testing.ports import free_port
from tests.cases.job_runs import pretrain


def hsdp_rank_layout(ctx, ranks_per_node: int, instances: int = 2, ep: int = 1) -> dict:
    """The adapter's dense and expert axes under ``--num-distributed-optimizer-instances instances``,
    as global ranks, and the node (``rank // ranks_per_node``) of each."""
    from megatron.fsdp.mcore.distributed_index import FSDPDistributedIndex
    from megatron.fsdp_training.testing.gpt import Topology, parallel

    with parallel(ctx, Topology(instances=instances, ep=ep)):
        index = FSDPDistributedIndex.from_parallel_state(instances, instances)

        def ranks(group):
            return dist.get_process_group_ranks(group)
        axes = {"dp_shard": ranks(index.mesh.inner_group), "dp_outer": ranks(index.mesh.outer_group),
                "expt_dp_shard": ranks(index.expert_mesh.inner_group),
                "expt_dp_outer": ranks(index.expert_mesh.outer_group)}
    return {name: [(r, r // ranks_per_node) for r in group] for name, group in axes.items()}

SCRIPT = os.path.join(ROOT, "examples", "sbatch_pretrain.sh")
# srun's stand-in: records its command, then runs it once per "node" (SLURM_NODEID k), all at once.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
printf '%s\\0' "$@" > "$SRUN_RECORD"
pids=()
for ((k = 0; k < SLURM_NNODES; k++)); do SLURM_NODEID=$k "$@" & pids+=($!); done
rc=0; for pid in "${pids[@]}"; do wait "$pid" || rc=1; done; exit $rc
"""
# The script's settings for a tiny HSDP run: 2 "nodes" x 2 ranks, ZeRO-3 inside a node, replicas across.
TINY = dict(SLURM_NNODES="2", GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1", DP_OUTER="2", NUM_LAYERS="2",
            HIDDEN_SIZE="64", NUM_HEADS="4", SEQ_LENGTH="32", MBS="2", GBS="8", TRAIN_ITERS="3",
            LR_WARMUP_ITERS="1", LOG_INTERVAL="1", EVAL_INTERVAL="3", EVAL_ITERS="1", SAVE_INTERVAL="3")


def _sbatch_on_two_nodes(tmp_path, output):
    """``examples/sbatch_pretrain.sh`` as SLURM would run it on 2 nodes; returns the output and the
    argument list the script gave ``pretrain_gpt.py``."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    srun = tmp_path / "bin" / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    record = tmp_path / "srun_command"
    env = dict(os.environ, **TINY, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()),
               OUTPUT_PATH=str(output), SRUN_RECORD=str(record), PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    env.pop("SLURM_JOB_ID", None)
    out = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    command = record.read_text().split("\0")[:-1]
    torchrun = command[command.index("-c") + 1]
    assert "--nnodes" in torchrun and "--node-rank" in torchrun and "--nproc-per-node" in torchrun
    script = next(i for i, a in enumerate(command) if a.endswith("pretrain_gpt.py"))
    assert command[script - 4:script] == ["2", "127.0.0.1", env["MASTER_PORT"], "2"]  # nodes, address, port, ranks
    return out.stdout, command[script + 1:]


def _tensors(checkpoint_dir, tmp_path, name):
    """Every tensor of the last checkpoint under ``checkpoint_dir``, by key (DCP read in this process)."""
    iteration = sorted(d for d in os.listdir(checkpoint_dir) if d.startswith("iter_"))[-1]
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(os.path.join(checkpoint_dir, iteration), out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", torch.load(out, weights_only=False))
    return flat


def test_sbatch_script_on_two_nodes_is_bitwise_the_one_node_run(tmp_path):
    """Two torchruns (``--nnodes 2 --node-rank k --master-addr 127.0.0.1 --master-port P --nproc-per-node 2``),
    started side by side by the SLURM script, against the same arguments on one 4-rank "node" (the pool)."""
    log, argv = _sbatch_on_two_nodes(tmp_path, tmp_path / "two")
    assert "mesh dp_shard 2 x dp_outer 2" in log and "levels optim_grads_params (dp_shard)" in log
    save = argv.index("--save") + 1
    one = pretrain(4, argv[:save] + [str(tmp_path / "one" / "checkpoints")] + argv[save + 1:])
    rows = [(int(i), float(loss), float(norm)) for i, loss, norm in LINE.findall(log)]
    assert [r[0] for r in rows] == [1, 2, 3]
    for (_, loss, norm), want_loss, want_norm in zip(rows, one["losses"], one["grad_norms"]):
        assert f"{loss:.6E}" == f"{want_loss:.6E}" and abs(norm - want_norm) <= 5e-4 * want_norm
    ours = _tensors(tmp_path / "two" / "checkpoints", tmp_path, "two")
    theirs = _tensors(tmp_path / "one" / "checkpoints", tmp_path, "one")
    assert any("optimizer" in k for k in theirs) and any("optimizer" not in k for k in theirs)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():  # weights, Adam's moments, RNG states: bitwise
        assert torch.equal(ours[key], value), key


def test_hsdp_shard_axis_inside_a_node_replica_axis_across_nodes():
    layout = pool_of(4).run(hsdp_rank_layout, timeout=120, ranks_per_node=2, instances=2)
    for rank, axes in enumerate(layout):
        assert [r for r, _ in axes["dp_shard"]] == [rank - rank % 2, rank - rank % 2 + 1]
        assert len({node for _, node in axes["dp_shard"]}) == 1  # one node: the shard axis's traffic stays inside it
        assert [node for _, node in axes["dp_outer"]] == [0, 1]  # one rank per node: the replicas span the nodes
        assert axes["expt_dp_shard"] == axes["dp_shard"] and axes["expt_dp_outer"] == axes["dp_outer"]
