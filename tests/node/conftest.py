"""Fixtures shared by the node's engine tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests, restored afterwards: the tiny model gains nothing
    from a second one, and on a busy 2-core machine its spinning barriers made these tests
    several times slower. A module asks for it with ``pytestmark``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
