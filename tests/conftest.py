import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the tests live in one folder per floor (tests/<floor>/test_*.py); their shared helpers stay here
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

# Tiny test tensors: one thread avoids thread-pool overhead that dominates at these sizes.
torch.set_num_threads(1)
