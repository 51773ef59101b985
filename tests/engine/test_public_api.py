"""``megatron.fsdp``'s public API is the user's: what wraps and trains a model, its policies, the mesh,
state dicts and checkpoint checks, FP8 weights, and what a model reports. Internals (units, layouts,
the levels' parsers) are imported from their modules. The API is in docs/engine.md, "API".
"""

import inspect
import warnings

import pytest
import torch

import megatron.fsdp as mfsdp

PUBLIC = [
    "fully_shard", "FullyShardedModule", "FullyShardedOptimizer", "megatron_no_weight_decay",
    "MixedPrecision", "QuantizedParamGather", "OptimizerPrecision", "Overlap", "ExpertSharding",
    "GradNorm", "PerMatrixOptimizer", "LabelledGroups", "MetaInit",
    "DataParallelMesh", "build_mesh",
    "model_state_dict", "optimizer_state_dict", "load_model_state_dict", "load_optimizer_state_dict",
    "check_checkpoint_keys",
    "quantized_weight", "QuantizedWeight",
    "PersistentMemory", "Ledger", "CollectiveError", "shutdown",
]


def test_all_is_the_users_api():
    assert mfsdp.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(mfsdp, name) is not None
    for internal in ("FSDPUnit", "UnitState", "FlatLayout", "ParamSpec", "build_layout", "TensorShards",
                     "valid_pairs", "STRATEGIES", "ShardingStrategy", "MeshStrategy", "parse_strategy",
                     "parse_mesh_strategy", "LedgerEvent"):
        assert not hasattr(mfsdp, internal), internal


def test_fully_shard_takes_an_overlap():
    params = list(inspect.signature(mfsdp.fully_shard).parameters)
    assert params == ["module", "strategy", "unit_modules", "mesh", "mixed_precision", "no_weight_decay",
                      "outer_strategy", "average_grads", "experts", "overlap", "meta_init"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mfsdp.fully_shard(torch.nn.Linear(2, 2), overlap=mfsdp.Overlap(forward_prefetch=2))
    assert model.overlap == mfsdp.Overlap(forward_prefetch=2)
    assert mfsdp.fully_shard(torch.nn.Linear(2, 2)).overlap == mfsdp.Overlap()


def test_the_previous_keywords_are_refused_by_python():
    """The previous release's keywords (``forward_prefetch=``, ``process_group=``, ``state_dtype=`` ...) are gone:
    Python refuses them by name, and an option given as something else than its value says what it must be."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'forward_prefetch'"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), forward_prefetch=0)
    with pytest.raises(TypeError, match="overlap must be a megatron.fsdp.Overlap, got int"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), overlap=2)
    model = mfsdp.fully_shard(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'state_dtype'"):
        mfsdp.FullyShardedOptimizer(model, torch.optim.Adam, lr=0.1, state_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="precision must be a megatron.fsdp.OptimizerPrecision"):
        mfsdp.FullyShardedOptimizer(model, precision=torch.bfloat16)


def test_optimizer_takes_one_value_per_concern():
    params = list(inspect.signature(mfsdp.FullyShardedOptimizer).parameters)
    assert params == ["models", "optimizer_cls", "clip_grad", "no_weight_decay", "grad_norm", "matrix", "precision",
                      "labelled_groups", "optimizer_kwargs"]
