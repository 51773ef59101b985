"""Prompt a checkpoint this project wrote and print what the model says, token by token.

The installed ``megatron-fsdp-generate`` (``python -m megatron.fsdp_training.tools.generate``),
run from a clone.
"""

import os
import sys

if __name__ == "__main__":
    # the clone on sys.path, not tools/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    from megatron.fsdp_training.tools.generate import main

    main()
