"""benchmarks/_memory.py, the memory figures of bench_backward.py: a step's peak resident memory above the level
before it (whatever came before), and its saved and host-moved bytes, on steps whose figures are known."""
import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import child_env

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _memory  # noqa: E402

MiB = 2**20
# Linux counts a process's resident pages in batches per thread (up to 64 pages each, then added up): its figures
# are exact to within that
SLACK = MiB
CPU = torch.device("cpu")
linux_only = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's /proc")


def allocates(n_mib: int):
    """A step that holds n MiB at its peak (every page written), then frees it. Above 32 MiB, glibc's largest
    mmap threshold, the block is pages of its own, none of them resident before."""
    def step() -> None:
        held = torch.ones(n_mib * MiB, dtype=torch.uint8)
        assert int(held[::4096].sum()) == n_mib * MiB // 4096
    return step


@linux_only
def test_a_step_that_allocates_n_mib_peaks_at_least_n_mib_above_the_level_before():
    peak = _memory.measure(allocates(64), CPU).peak
    assert 64 * MiB - SLACK <= peak < 80 * MiB


@linux_only
def test_memory_held_before_the_step_is_not_counted():
    held = torch.ones(128 * MiB, dtype=torch.uint8)
    peak = _memory.measure(allocates(40), CPU).peak
    assert 40 * MiB - SLACK <= peak < 56 * MiB
    del held


@linux_only
def test_an_earlier_higher_peak_is_forgotten():
    allocates(256)()  # the process's high-water mark is now at least 256 MiB above its current size
    peak = _memory.measure(allocates(40), CPU).peak
    assert 40 * MiB - SLACK <= peak < 56 * MiB


def test_saved_bytes_count_activations_once_and_the_store_moves_each_saved_one_both_ways():
    w = torch.randn(256, 1024, requires_grad=True)  # a leaf that requires grad: kept by reference, not counted
    x = torch.randn(256, 1024).requires_grad_()

    def step() -> None:
        h = x * 2  # saves nothing (a constant factor)
        y = h * w  # saves h (1 MiB) and w
        z = y.sin()  # saves y (1 MiB)
        (z * h).sum().backward()  # saves h again (the same storage: counted once) and z (1 MiB)

    memory = _memory.measure(step, CPU)
    assert memory.saved == 3 * MiB
    assert memory.moved == 2 * 4 * MiB  # h, y, h again, z: there and back
    assert w.grad is not None and x.grad is not None


def test_saved_bytes_fall_as_the_backward_frees_what_it_used():
    meter = _memory.SavedBytes()
    x = torch.randn(256, 1024, requires_grad=True)
    with meter.hooks():
        loss = x.sin().cos().exp().sum()
    assert meter.live == meter.peak == 2 * MiB  # sin's input x is a weight-like leaf; cos's input, exp's output
    loss.backward()
    assert meter.live == 0 and meter.peak == 2 * MiB


@pytest.mark.realtime
@pytest.mark.slow
@linux_only
def test_a_child_process_measures_one_configuration_and_reports_its_figures():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "_memory.py"), "study", "plain", "8", "--size", "16"],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    memory = _memory.Memory(**__import__("json").loads(proc.stdout.strip().splitlines()[-1]))
    assert memory.peak > 0 and memory.moved >= 2 * memory.saved > 0


@pytest.mark.realtime
@pytest.mark.slow
@linux_only
def test_the_benchmark_table_shows_layerwise_holding_what_the_whole_batch_saves():
    """bench_backward.py end to end, memory only: layerwise keeps the whole batch's saved tensors, and the whole
    batch's step peaks above plain accumulation's at 4 micro-batches."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_backward.py"), "--models", "study", "--ks", "4",
                           "--rounds", "0", "--size", "16", "--schedules", "layerwise", "--markdown"],
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header, row = (next(line for line in lines if line.startswith(start)).split("|")[1:-1]
                   for start in ("| model", "| study"))  # the full table's, ahead of the summary's
    cells = dict(zip((h.strip() for h in header), (c.strip() for c in row)))
    plain, whole, layerwise = (float(v) for v in cells["saved MiB plain/whole/layerwise"].split(" / "))
    assert layerwise == whole > 2 * plain
    assert float(cells["whole peak MiB"].split()[0]) > float(cells["plain peak MiB"])
    assert cells["K x b"] == "4x8" and cells["BN"] == "4"


def test_a_child_process_reports_the_schedule_an_exact_step_ran_with_its_setting():
    ran = {}
    for method in ("plain", "segments:keep_every=3"):
        proc = subprocess.run([sys.executable, str(BENCHMARKS / "_memory.py"), "study", method, "8", "--size", "16"],
                              env=child_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        ran[method] = _memory.Memory(**__import__("json").loads(proc.stdout.strip().splitlines()[-1])).ran
    assert ran == {"plain": "", "segments:keep_every=3": "segments(keep_every=3)"}
    runs = [_memory.Memory(1, 1, 1, ran=r) for r in ("recompute", "segments(keep_every=1)", "recompute")]
    assert _memory.median_memory(runs).ran == "recompute / segments(keep_every=1)"  # each that ran, once


@pytest.mark.realtime
@pytest.mark.slow
@linux_only
def test_auto_at_a_budget_relative_to_plains_peak_runs_after_plain_and_says_what_ran():
    """bench_backward.py end to end, memory only: "auto" at 1.5x plain's peak, measured at each K after plain's, its
    peak and the schedule that ran beside it."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_backward.py"), "--models", "study", "--ks", "4",
                           "--rounds", "0", "--size", "16", "--schedules", "auto:memory_budget=1.5x", "--markdown",
                           "--peak-runs", "1"], env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header, row = (next(line for line in lines if line.startswith(start)).split("|")[1:-1]
                   for start in ("| model", "| study"))
    cells = dict(zip((h.strip() for h in header), (c.strip() for c in row)))
    assert cells["auto:memory_budget=1.5x ran"] in ("layerwise", "recompute", "passes") or cells[
        "auto:memory_budget=1.5x ran"].startswith("segments(keep_every="), cells
    assert float(cells["auto:memory_budget=1.5x peak MiB"].split()[0]) > 0


@pytest.mark.slow
@linux_only
def test_the_allocator_a_run_measures_with_is_set_in_every_process_and_said():
    """--allocator mmap: the header says what glibc does, and each fresh process measures under it."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_backward.py"), "--models", "study", "--ks", "4",
                           "--rounds", "0", "--size", "16", "--schedules", "layerwise", "--peak-runs", "1",
                           "--allocator", "mmap"], env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "glibc mapping blocks of 64 KiB and more" in proc.stdout.splitlines()[0]
    child = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import _memory; "
                            "print(_memory.use_allocator('mmap'), _memory.use_allocator('glibc'), sep='|')",
                            str(BENCHMARKS)], env=child_env(), capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == "glibc mapping blocks of 64 KiB and more|glibc's defaults", child.stderr


def test_each_figure_is_the_median_of_the_fresh_processes_runs_the_methods_interleaved():
    peaks = {"plain": iter([30, 10, 20]), "layerwise": iter([5, 50, 40])}
    calls = []

    def stub(name, method, micro, args, timeout):
        calls.append(method)
        return _memory.Memory(next(peaks[method]), 7, 14)

    args = argparse.Namespace(peak_runs=3)
    got = _memory.measure_runs("study", ["plain", "layerwise"], 4, args, 60.0, measure=stub)
    assert got == {"plain": _memory.Memory(20, 7, 14, (30, 10, 20)),
                   "layerwise": _memory.Memory(40, 7, 14, (5, 50, 40))}
    assert calls == ["plain", "layerwise"] * 3  # run by run, not method by method


def test_a_median_is_a_figure_one_run_measured_and_a_failed_run_fails_the_configuration():
    assert _memory.median_memory([_memory.Memory(10, 1, 2), _memory.Memory(30, 1, 2)]) == _memory.Memory(
        10, 1, 2, (10, 30))
    calls = []

    def fails(name, method, micro, args, timeout):
        calls.append(method)
        return "failed"

    args = argparse.Namespace(peak_runs=3)
    assert _memory.measure_runs("study", ["passes"], 1, args, 60.0, measure=fails) == {"passes": "failed"}
    assert calls == ["passes"]  # no run after a failed one
