"""Every script in examples/ runs on a tiny slice of MNIST and prints its final metric.

examples/ddp.py runs in tests/test_distributed.py, under torchrun and in one process.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--data", str(ROOT.parent / "shared" / "data" / "mnist-mini"), "--val-samples", "64"]
RUNS = {  # name: (script, arguments besides TINY)
    "finetune_resnet18": ("finetune_resnet18.py", ["--steps", "2", "--batch-size", "4", "--micro-batch-size", "2"]),
    "finetune_resnet18 from weights, frozen, bn-eval": (
        "finetune_resnet18.py", ["--steps", "2", "--batch-size", "4", "--micro-batch-size", "2", "--weights",
                                 "{tmp}/resnet18.pth", "--freeze-backbone", "--bn-eval"]),
    "bf16_autocast": ("bf16_autocast.py", ["--steps", "3", "--batch-size", "8", "--micro-batch-size", "4"]),
    "lightning_mnist": ("lightning_mnist.py", ["--steps", "3", "--batch-size", "8", "--micro-batch-size", "4",
                                               "--precision", "bf16-mixed"]),
    "accelerate_mnist": ("accelerate_mnist.py", ["--steps", "3", "--batch-size", "8", "--micro-batch-size", "4",
                                                 "--checkpoint", "{tmp}/state"]),
}


def test_every_example_is_run_by_a_test():
    scripts = {path.name for path in (ROOT / "examples").glob("*.py")}
    assert scripts == {script for script, _ in RUNS.values()} | {"ddp.py"}


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_example_prints_its_final_metric(run, tmp_path):
    script, args = RUNS[run]
    if "--weights" in args:  # a state dict in the layout torchvision's pretrained files have
        torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet18.pth")
    args = [a.format(tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *TINY, *args], cwd=tmp_path,
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = re.search(r"final val_acc (\d\.\d+) on 64 digits", proc.stdout)
    assert found and 0 <= float(found.group(1)) <= 1, proc.stdout[-2000:]
    if "--checkpoint" in args:
        assert (tmp_path / "state" / "optimizer.bin").is_file()
