"""A worker process's settings, applied on import, before torch or Megatron-Core is imported.

Imported first by every pool worker, and by the forkserver the session's workers are
forked from (``megatron/fsdp_training/testing/pools.py``), so the imports made there are as quiet as a
worker's own: no TorchDynamo, no FutureWarning, none of the notices a CPU worker pool
would repeat once per process (they would interleave with the report tools' rows).
"""

import faulthandler
import os
import warnings

faulthandler.enable()  # a worker killed by a signal (SIGSEGV, SIGBUS) prints every thread's stack first
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

from megatron.fsdp.library_warnings import silence_unactionable_warnings  # noqa: E402

silence_unactionable_warnings(cpu_worker_pool=True)
