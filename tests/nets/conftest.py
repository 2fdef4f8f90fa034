"""Fixtures of the network tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One torch thread for the test: the small networks here run faster on one (and alike on any machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
