"""tests/algo: one torch thread (the machine is shared)."""

import torch

torch.set_num_threads(1)
