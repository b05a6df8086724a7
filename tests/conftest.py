"""pytest configuration: every test starts from the same seed; a test taking `schedule` runs under each exact one;
`one_thread` for tests of small tensors."""
import pytest
import torch

from helpers import EXACT_SCHEDULES, schedule_named


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=EXACT_SCHEDULES)
def schedule(request):
    with schedule_named(request.param) as name:
        yield name


@pytest.fixture
def one_thread():
    """Small tensors run fastest on one thread, and much slower with two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
