"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Node threads share the test process: intra-op thread pools would only contend
    (`pytestmark = pytest.mark.usefixtures("one_torch_thread")` in a module)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
