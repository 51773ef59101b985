"""``megatron.fsdp``'s public API is the user's: what wraps and trains a model, its policies, the mesh,
state dicts and checkpoint checks, FP8 weights, and what a model reports. Internals (units, layouts,
the levels' parsers) are imported from their modules. The API is in docs/engine.md, "API".
"""

import inspect
import warnings

import pytest
import torch

import megatron.fsdp as mfsdp
import megatron.fsdp.wrap.build as build

PUBLIC = [
    "fully_shard", "FullyShardedModule", "FullyShardedOptimizer", "megatron_no_weight_decay",
    "MixedPrecision", "QuantizedParamGather", "OptimizerPrecision", "Overlap", "ExpertSharding",
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
    assert params == ["module", "strategy", "unit_modules", "process_group", "mixed_precision", "no_weight_decay",
                      "mesh", "outer_strategy", "average_grads", "experts", "overlap", "device", "init_weights",
                      "double_buffer", "param_gather", "deprecated"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mfsdp.fully_shard(torch.nn.Linear(2, 2), overlap=mfsdp.Overlap(forward_prefetch=2))
    assert model.overlap == mfsdp.Overlap(forward_prefetch=2)
    assert mfsdp.fully_shard(torch.nn.Linear(2, 2)).overlap == mfsdp.Overlap()


def test_old_overlap_keywords_warn_once(monkeypatch):
    monkeypatch.setattr(build, "_warned_overlap_keywords", False)
    with pytest.warns(DeprecationWarning, match=r"pass overlap=Overlap\(\.\.\.\)") as record:
        model = mfsdp.fully_shard(torch.nn.Linear(2, 2), forward_prefetch=0, reductions_in_flight=3)
        mfsdp.fully_shard(torch.nn.Linear(2, 2), backward_prefetch=0)
    assert len([w for w in record if issubclass(w.category, DeprecationWarning)]) == 1
    assert model.overlap == mfsdp.Overlap(forward_prefetch=0, reductions_in_flight=3)
    with pytest.raises(ValueError, match="not both"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), overlap=mfsdp.Overlap(), forward_prefetch=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefetch'"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), prefetch=0)
