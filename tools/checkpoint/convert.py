"""Convert a checkpoint to one torch file of full tensors, a HuggingFace model or Megatron's torch_dist, and back.

The installed ``megatron-fsdp-convert`` (``python -m megatron.fsdp_training.tools.checkpoint_tools.convert``),
run from a clone.
"""

import os
import sys

if __name__ == "__main__":
    # the clone on sys.path, not this folder: its inspect.py is not the standard library's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    from megatron.fsdp_training.tools.checkpoint_tools.convert import main

    main()
