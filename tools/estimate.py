"""What a ``pretrain_gpt.py`` configuration keeps, allocates, sends and saves per rank at any world size (a
simulation in one process).

The installed ``megatron-fsdp-estimate`` (``python -m megatron.fsdp_training.tools.estimate``), run from a clone.
"""

import os
import sys

if __name__ == "__main__":
    # the clone on sys.path, not tools/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    from megatron.fsdp_training.tools.estimate.cli import main

    main()
