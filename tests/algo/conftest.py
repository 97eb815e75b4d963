"""tests/algo: one torch thread (the machine is shared), reference module importable."""

import torch

torch.set_num_threads(1)
