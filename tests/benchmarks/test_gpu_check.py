"""benchmarks/gpu_check.py without a GPU: it says so with its own exit status, and its table machinery
reports every check, a failing one included, without one hiding another."""
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import child_env

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402
from _gpu_steps import verdict  # noqa: E402


@pytest.mark.realtime
def test_without_a_gpu_it_checks_nothing_and_says_so_with_exit_status_77():
    proc = subprocess.run([sys.executable, str(SCRIPT)], env={**child_env(), "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == gpu_check.NO_GPU == 77, proc.stderr
    assert proc.stdout.startswith("no CUDA GPU present: nothing checked") and proc.stdout.count("\n") == 1


def test_a_failing_check_is_one_fail_row_and_the_others_still_run(monkeypatch, capsys):
    def passes(device):
        return [verdict("fine", "a case", 1e-6, 1e-4)]

    def raises(device):
        raise RuntimeError("CUDA error: an illegal memory access\nmore lines")

    checks = {"first": (raises, (), False), "second": (passes, (), False), "gpu only": (passes, (), True)}
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    assert gpu_check.main(["--device", "cpu"]) == 1
    captured = capsys.readouterr()
    table = [line.split("|")[1:-1] for line in captured.out.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in row] for row in table[2:]]
    assert rows == [["first", "raised", "RuntimeError: CUDA error: an illegal memory access", "", "FAIL"],
                    ["fine", "a case", "1.0e-06", "<= 1.0e-04", "PASS"],
                    ["gpu only", "-", "", "", "SKIP (needs CUDA)"]]
    assert "Traceback" in captured.err and "illegal memory access" in captured.err
    monkeypatch.setattr(gpu_check, "CHECKS", {"second": checks["second"]})
    assert gpu_check.main(["--device", "cpu"]) == 0


@pytest.mark.realtime
@pytest.mark.cuda
@pytest.mark.slow
def test_every_gpu_check_passes_on_this_gpu():
    """On a GPU machine the suite runs the script itself (a few minutes)."""
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
