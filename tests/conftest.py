"""pytest configuration: every test starts from the same seed; a test taking `schedule` runs under each exact one."""
import pytest
import torch

from helpers import EXACT_SCHEDULES


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=EXACT_SCHEDULES)
def schedule(request):
    return request.param
