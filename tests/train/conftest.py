"""One thread per test process: the machine has 2 cores shared by everything. One pair of gloo trainer ranks for
the session (starting one costs ~5 s of imports a rank): tests that use it load the state they start from."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """2 spawned gloo ranks of the tiny GPT-2 (``tests.train.test_train_worker._spec("token-mean")``)."""
    from psrl.train.launch import LocalRanks
    from tests.train.test_train_worker import WAIT_S, _spec

    ranks = LocalRanks(_spec("token-mean"), 2, reply_timeout_s=WAIT_S, log_dir=tmp_path_factory.mktemp("ranks"))
    yield ranks
    ranks.close()
