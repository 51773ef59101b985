"""The engine tests' pytest-side checks: the unsharded reference, parity with it, memory formulas, resume."""

import functools

from megatron.fsdp.testing.common import rel
from megatron.fsdp.testing.engine_training import RunConfig, reference_run, sharded_run


FP32_RTOL = 1e-5


@functools.lru_cache(maxsize=None)
def reference(cfg: RunConfig):
    return reference_run(cfg)


def assert_parity(result, ref, rtol, param_atol):
    for name in ("losses", "grad_norms"):
        errs = [rel(a, b) for a, b in zip(result[name], ref[name])]
        assert len(result[name]) == len(ref[name])
        assert max(errs) <= rtol, f"{name}: {result[name]} vs reference {ref[name]} (max rel err {max(errs):.2e})"
    assert_params_close(result["params"], ref["params"], param_atol)


def assert_params_close(params, ref_params, param_atol):
    """Every reference parameter, within ``param_atol`` of the largest of its magnitude and 1."""
    assert set(ref_params) <= set(params)
    for name, expected in ref_params.items():
        got = params[name].to(expected.dtype)
        assert got.shape == expected.shape, name
        err = (got - expected).abs().max().item()
        assert err <= param_atol * max(1.0, expected.abs().max().item()), f"{name}: max abs err {err:.2e}"


def run(pool, cfg: RunConfig, world_size: int):
    results = pool.run(sharded_run, size=world_size, cfg=cfg)
    for r in results[1:]:  # every rank saw the same losses and norms
        assert r["losses"] == results[0]["losses"] and r["grad_norms"] == results[0]["grad_norms"]
    return results[0]


def assert_memory_matches_theory(results) -> None:
    """Every kind within 1% of the formula, in the step and between steps (gradients released
    by ``zero_grad``); no gradient memory from the build until the first backward."""
    for rank, result in enumerate(results):
        assert result["grads_at_build"] == 0, (rank, result["grads_at_build"])
        for when in ("", "_in_step"):
            report, theory = result["report" + when], result["theory" + when]
            for kind, expected in theory.items():
                got = report[kind]
                if expected == 0:
                    assert got == 0, (rank, when, kind, report)
                else:
                    assert abs(got / expected - 1) < 0.01, \
                        f"rank {rank}{when} {kind}: {got} bytes vs theory {expected:.0f}"


def assert_exact_resume(result):
    """The engine checkpoint cases' result: weights, compute weights and the continued run as saved."""
    assert result["params_equal"], "full parameters after load differ from the saved ones"
    assert result["compute_matches_main"], "compute weights were not rebuilt from the loaded main weights"
    assert result["resumed"] == result["straight"], (result["resumed"], result["straight"])
