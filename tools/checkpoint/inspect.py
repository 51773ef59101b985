"""Print what a checkpoint holds: iteration, arguments, and every key with its shape and dtype.

The installed ``megatron-fsdp-inspect`` (``python -m megatron.fsdp_training.tools.checkpoint_tools.inspect``),
run from a clone.
"""

import os
import sys

if __name__ == "__main__":
    # the clone on sys.path, not this folder: its inspect.py is not the standard library's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    from megatron.fsdp_training.tools.checkpoint_tools.inspect import main

    main()
