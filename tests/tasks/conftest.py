"""One thread per test process: the machine has 2 cores shared by everything."""

import torch

torch.set_num_threads(1)
