"""The C heap's free memory handed back to the OS (`memory.heap`): what the call does, where it is made."""
from __future__ import annotations

import copy
import sys

import pytest
import torch

import accumnorm
from accumnorm._engine.memory import heap
from helpers import ce_loss, exact_vs_whole_batch
from models import data, resnet


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(heap._TRIM is None, reason="the C library is not glibc: there is no malloc_trim")
def test_the_free_pages_a_fragmented_heap_keeps_go_back_to_the_os():
    """Blocks freed between blocks still in use cannot be joined and handed back from the heap's top: they stay
    resident until the call."""
    freed, kept = [], []
    for _ in range(400):  # blocks of 80 KiB and 4 KiB in turn, under glibc's mmap threshold: from the heap
        freed.append(torch.ones(20_000))
        kept.append(torch.ones(1024))
    del freed
    before = _resident()
    heap.release_free_memory(torch.device("cpu"))
    assert before - _resident() > 16 << 20  # of the 31 MiB freed; pages a block shares with its neighbours stay
    assert all(bool((t == 1).all()) for t in kept)


def test_only_a_cpu_step_calls_it(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_TRIM", lambda pad: calls.append(pad) or 1)
    heap.release_free_memory(torch.device("meta"))
    assert calls == []
    heap.release_free_memory(torch.device("cpu"))
    assert calls == [0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is looked for on Linux only")
def test_glibc_is_found_where_it_is_the_c_library():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the C library is not glibc")
    assert heap._TRIM is not None


class _Resident:
    """A process whose resident size grows by `step` bytes at each reading, and falls to `after_trim` at a trim."""

    def __init__(self, step: int, after_trim: int) -> None:
        self.size, self.step, self.after_trim, self.trims = 0, step, after_trim, 0

    def read(self) -> int:
        self.size += self.step
        return self.size

    def trim(self, pad: int) -> int:
        self.trims += 1
        self.size = self.after_trim
        return 1


def _bound(monkeypatch, process: _Resident, budget: int | None, device: str = "cpu") -> heap.ResidentBound:
    monkeypatch.setattr(heap, "_TRIM", process.trim)
    monkeypatch.setattr(heap, "_PAGE", 4096)
    monkeypatch.setattr(heap.ResidentBound, "_resident", process.read)
    return heap.ResidentBound(budget, torch.device(device))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident size is read from Linux's /proc")
def test_the_bound_trims_only_once_the_step_has_added_four_fifths_of_its_budget(monkeypatch):
    process = _Resident(step=10, after_trim=0)
    bound = _bound(monkeypatch, process, budget=100)  # reads 10: the level the step starts from
    bound.start()
    try:
        for _ in range(8):  # 20, 30, ... 90: at most 80 above the start
            bound.check()
        assert process.trims == 0
        bound.check()  # 100: 90 above
        assert process.trims == 1
    finally:
        bound.close()
    assert bound.fd is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident size is read from Linux's /proc")
def test_a_trim_that_leaves_the_step_near_its_budget_waits_for_half_the_room_left(monkeypatch):
    # The live tensors near the budget: a trim at every check would fault the same pages in again and again.
    process = _Resident(step=1, after_trim=190)
    bound = _bound(monkeypatch, process, budget=200)  # 1
    bound.start()
    process.size = 170
    bound.check()  # 171: 170 above the start, past 160; trimmed to 190, which reads 191
    assert process.trims == 1 and bound.trigger == 190 + (200 - 190) // 2
    for _ in range(5):  # 192 ... 196: 195 above the start at most, not past 195
        bound.check()
    assert process.trims == 1
    bound.check()  # 197: 196 above
    assert process.trims == 2
    bound.close()


@pytest.mark.parametrize(("budget", "device"), [(None, "cpu"), (100, "meta")])
def test_without_a_budget_or_off_the_cpu_the_bound_reads_nothing(monkeypatch, budget, device):
    process = _Resident(step=1000, after_trim=0)
    bound = _bound(monkeypatch, process, budget=budget, device=device)
    bound.start()
    bound.check()
    bound.close()
    assert process.size == 0 and process.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident size is read from Linux's /proc")
@pytest.mark.parametrize("schedule", ["segments", "recompute", "layerwise", "passes"])
@pytest.mark.parametrize("budget", [1 << 30, None])
def test_a_step_with_a_budget_reads_its_resident_memory_at_its_turns_passes_and_recomputations(
        monkeypatch, schedule, budget):
    """Each reading here is past any budget, so each check trims: at the lockstep forward's turns, after each
    micro-batch's pass of passes, and in the lockstep schedules' backward (at each saved tensor it unpacks, and before
    each recomputation). The step stays exact. Without a budget nothing is read."""
    reads = {"forward": 0, "backward": 0}

    def resident(bound):
        reads["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
        return (reads["forward"] + reads["backward"]) << 40

    trims = []
    monkeypatch.setattr(heap.ResidentBound, "_resident", resident)
    monkeypatch.setattr(heap, "_TRIM", lambda pad: trims.append(pad) or 1)
    monkeypatch.setattr(heap, "_PAGE", 4096)
    torch.manual_seed(0)
    ref = resnet().double()
    exact_vs_whole_batch(ref, copy.deepcopy(ref), data((1, 12, 12), 8, torch.float64), 2, 1e-9,
                         schedule=schedule, memory_budget=budget)
    if budget is None:
        assert reads == {"forward": 0, "backward": 0}
        return
    assert reads["forward"] > 1, reads
    assert (reads["backward"] > 0) == (schedule != "passes"), reads
    # every check trims: a reading before and one after each, and one at the start
    assert len(trims) >= (sum(reads.values()) - 1) // 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident size is read from Linux's /proc")
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failed_segments_step_leaves_no_file_of_its_bound_open(monkeypatch, where):
    opened = []
    start = heap.ResidentBound.start

    def noting(bound):
        start(bound)
        opened.append(bound)

    monkeypatch.setattr(heap.ResidentBound, "start", noting)
    model = resnet().double()
    x, y = data((1, 12, 12), 8, torch.float64)

    def loss_fn(m, batch):
        out = m(batch[0])
        if where == "forward" and batch[0].shape[0] == 2 and torch.equal(batch[0], x[2:4]):
            raise RuntimeError("failure in micro-batch 1")
        if where == "backward":
            out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("failure in the backward")))
        return torch.nn.functional.cross_entropy(out, batch[1])

    with pytest.raises(RuntimeError, match="failure in"):
        accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=2, schedule="segments", memory_budget=1 << 30)
    assert opened and all(bound.fd is None for bound in opened)


@pytest.mark.skipif(heap._TRIM is None, reason="the C library is not glibc: there is no malloc_trim")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident size is read from Linux's /proc")
def test_recomputes_bound_reads_its_resident_memory_at_each_saved_tensor_its_backward_reads(monkeypatch):
    """A region's backward for every micro-batch at once frees and makes much between two recomputations: the heap
    kept its free pages there, past the budget, where the bound read only before each recomputation. It now reads at
    each saved tensor the backward gives a region (and trims, each reading here being past any budget); exact."""
    from accumnorm._engine.checkpointing.recomputation import RegionFrame

    backward_reads, unpacks = [0], [0]

    def resident(bound):
        backward_reads[0] += torch._C._current_graph_task_id() != -1
        return 1 << 40

    unpack = RegionFrame.unpack

    def counted(frame, index):
        unpacks[0] += 1
        return unpack(frame, index)

    monkeypatch.setattr(heap.ResidentBound, "_resident", resident)
    monkeypatch.setattr(heap, "_TRIM", lambda pad: 1)
    monkeypatch.setattr(heap, "_PAGE", 4096)
    monkeypatch.setattr(RegionFrame, "unpack", counted)
    torch.manual_seed(0)
    ref = resnet().double()
    exact_vs_whole_batch(ref, copy.deepcopy(ref), data((1, 12, 12), 8, torch.float64), 2, 1e-9,
                         schedule="recompute", memory_budget=1 << 30)
    assert unpacks[0] > 0
    assert backward_reads[0] >= unpacks[0], (backward_reads, unpacks)


def _first_step_figure(ref: torch.nn.Module, ours: torch.nn.Module, batch) -> int:
    """A first, metered "auto" step of `ours` (a copy of `ref`), which measures layerwise's figure, then `ours` as
    `ref` again with no gradient: what the figure says the next step needs, gradients included."""
    accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, memory_budget=1 << 30)
    for p in ours.parameters():
        p.grad = None
    ours.load_state_dict(ref.state_dict())
    return accumnorm.last_schedule(ours).need


@pytest.mark.skipif(heap._TRIM is None, reason="the C library is not glibc: there is no malloc_trim")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident size is read from Linux's /proc")
@pytest.mark.parametrize("metered", [True, False], ids=["metered step", "step after a figure"])
def test_layerwises_bound_reads_its_resident_memory_at_each_saved_tensor_its_backward_reads(metered, monkeypatch):
    """The backward of the K graphs frees one layer's saved tensors of the whole batch and makes its gradients between
    two turns of the forwards: the heap kept its free pages there, past the budget (resnet18 at 64 px, 16 x 2, "auto"
    at 107 MiB: 117-123 MiB), where the bound read only at the forwards' turns. It now reads at each saved tensor the
    backward unpacks, in a metered step and in one that runs by an earlier step's figure (no meter) within a sixteenth
    of its budget; exact."""
    backward_reads, unpacks = [0], [0]

    def resident(bound):
        backward_reads[0] += torch._C._current_graph_task_id() != -1
        return 0  # no trim: only the readings are counted

    def counting(pack, unpack):
        def counted(packed):
            unpacks[0] += 1
            return unpack(packed)
        return saved_tensors_hooks(pack, counted)

    saved_tensors_hooks = torch.autograd.graph.saved_tensors_hooks
    monkeypatch.setattr(heap.ResidentBound, "_resident", resident)
    monkeypatch.setattr(heap, "_PAGE", 4096)
    torch.manual_seed(0)
    ref = resnet().double()
    ours = copy.deepcopy(ref)
    batch = data((1, 12, 12), 8, torch.float64)
    budget = 1 << 30
    if not metered:  # the next step runs by the first's figure, without a meter, near enough to keep the checks
        budget = 4 * _first_step_figure(ref, ours, batch)
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", counting)
    exact_vs_whole_batch(ref, ours, batch, 2, 1e-9, memory_budget=budget)
    assert accumnorm.last_schedule(ours).schedule == "layerwise"
    assert unpacks[0] > 0
    assert backward_reads[0] >= unpacks[0], (backward_reads, unpacks)


@pytest.mark.skipif(heap._TRIM is None, reason="the C library is not glibc: there is no malloc_trim")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident size is read from Linux's /proc")
@pytest.mark.parametrize(("share", "far"), [(1 / 32, True), (1 / 8, False)], ids=["a 32nd", "an 8th"])
def test_a_step_run_by_a_figure_far_below_its_budget_reads_no_resident_memory_and_saves_through_no_hook(
        share, far, monkeypatch):
    """The checks' hooks run at every tensor autograd saves: on a model of small layers, a sixth of the step's time
    (tiny_deep at 4 x 8: "auto" 1.45x plain's time, layerwise 1.25x). A step that "auto" runs by an earlier step's
    figure of at most a sixteenth of its budget, where they would never trim, runs without them; nearer, with them.
    Exact either way."""
    reads, hooked = [0], []

    def resident(bound):
        reads[0] += 1
        return 0  # no trim: only the readings are counted

    torch.manual_seed(0)
    ref = resnet().double()
    ours = copy.deepcopy(ref)
    ours[3].register_forward_pre_hook(  # whether saved-tensor hooks are on the thread, at the first block
        lambda m, args: hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None))
    batch = data((1, 12, 12), 8, torch.float64)
    need = _first_step_figure(ref, ours, batch)
    monkeypatch.setattr(heap.ResidentBound, "_resident", resident)
    hooked.clear()
    exact_vs_whole_batch(ref, ours, batch, 2, 1e-9, memory_budget=int(need / share))
    assert accumnorm.last_schedule(ours).schedule == "layerwise"
    assert hooked and (not any(hooked) if far else all(hooked)), hooked
    assert (reads[0] <= 1) == far, reads  # one reading when the bound is made, before the step knows its figure


@pytest.mark.skipif(heap._TRIM is None, reason="the C library is not glibc: there is no malloc_trim")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident size is read from Linux's /proc")
def test_segments_bound_reads_its_resident_memory_inside_each_region_pass_backward(monkeypatch):
    """A region's pass back-propagates one micro-batch's recomputation, freeing and making its tensors, where the
    bound read only before each recomputation ("auto" at 1.2x plain's peak on resnet18, 16 x 2: 90.7 MiB against
    85.8). It now also reads at each saved tensor that backward unpacks; exact."""
    from accumnorm._engine.checkpointing.region_passes import RegionPasses

    inside, checks, recomputes = [False], [0], [0]
    check, recompute, backward = heap.ResidentBound.check, RegionPasses._recompute, RegionPasses.backward

    def counted_check(bound):
        checks[0] += inside[0]
        return check(bound)

    def counted_recompute(passes, *args, **kwargs):
        recomputes[0] += inside[0]
        return recompute(passes, *args, **kwargs)

    def region_backward(passes, grads):
        inside[0] = True
        try:
            return backward(passes, grads)
        finally:
            inside[0] = False

    monkeypatch.setattr(heap.ResidentBound, "check", counted_check)
    monkeypatch.setattr(RegionPasses, "_recompute", counted_recompute)
    monkeypatch.setattr(RegionPasses, "backward", region_backward)
    torch.manual_seed(0)
    ref = resnet().double()
    exact_vs_whole_batch(ref, copy.deepcopy(ref), data((1, 12, 12), 8, torch.float64), 2, 1e-9, schedule="segments",
                         memory_budget=1 << 30)
    assert recomputes[0] > 0
    assert checks[0] > recomputes[0], (checks, recomputes)
