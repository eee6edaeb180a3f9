"""Test-session hygiene shared by every test module."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _default_dtype():
    """Oracles switch the default dtype to float64; no test sees another test's choice."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
