"""pytest configuration: each process of a parallel run (`-n auto`) takes its share of the cores; every test starts
from the same seed; a test taking `schedule` runs under each exact one, segments at two settings (`schedule_any`:
and "auto"); `one_thread` for tests of small tensors; `fresh_dynamo` for tests that torch.compile; tests marked
`cuda` skip, saying why, without a GPU."""
import os
import signal

import pytest
import torch

from accumnorm._engine.schedules.segments import Segments
from helpers import EXACT_SCHEDULES, STEP_SCHEDULES

# A shell without job control starts a background job (`.ci/run &`) with SIGINT ignored, and every process it starts
# inherits that: the tests of Ctrl-C would then send signals nothing receives. They test Python's KeyboardInterrupt,
# as in a terminal; a handler installed here is reset to the default in each child program, which installs Python's.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    # Each of the processes pytest-xdist runs the tests in takes its share of the cores: with torch's default of all
    # of them in each, their intra-op threads outnumber the cores and wait on each other.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked cuda: needs a CUDA GPU, and none is present")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=[*EXACT_SCHEDULES, pytest.param("segments:keep_every=1", id="segments_keep_every_1")])
def schedule(request, monkeypatch):
    """Each exact schedule's name; segments also at keep_every=1 (every region's arguments kept) beside its default
    (one region's in two recomputed), as its default for the test, so that the test passes only the name."""
    name, _, setting = request.param.partition(":")
    if setting:
        monkeypatch.setattr(Segments.__init__, "__defaults__", (1,))
    return name


@pytest.fixture(params=STEP_SCHEDULES)
def schedule_any(request):
    """Every value of `schedule`, "auto" too."""
    return request.param


@pytest.fixture
def one_thread():
    """Small tensors run fastest on one thread, and much slower with two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """The test compiles afresh, and leaves no compiled code behind: tests that torch.compile stay independent."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
