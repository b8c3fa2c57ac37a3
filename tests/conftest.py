import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny test tensors: one thread avoids thread-pool overhead that dominates at these sizes.
torch.set_num_threads(1)
