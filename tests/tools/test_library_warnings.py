"""The central filter drops the library notices a newcomer cannot act on, and nothing else."""

import logging
import warnings

from megatron.fsdp.library_warnings import silence_unactionable_warnings


def test_unactionable_notices_are_filtered_and_others_are_not(caplog):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_unactionable_warnings(cpu_worker_pool=True)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("Megatron-Core CPU mode is on: CUDA calls are redirected to CPU")
        warnings.warn("something a user should see")
    assert [str(w.message) for w in seen] == ["something a user should see"]
    with caplog.at_level(logging.WARNING):
        rerun = logging.getLogger("megatron.core.rerun_state_machine")
        rerun.warning("Implicit initialization of Rerun State Machine!")
        rerun.warning("RerunStateMachine initialized in mode RerunMode.DISABLED")
        rerun.warning("RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS")
    assert [r.getMessage() for r in caplog.records] == ["RerunStateMachine initialized in mode "
                                                        "RerunMode.VALIDATE_RESULTS"]
