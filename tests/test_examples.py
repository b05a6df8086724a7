"""Every script in examples/ runs on a tiny slice of MNIST and prints its final metric.

examples/ddp.py runs in tests/engine/test_distributed.py, under torchrun and in one process;
examples/yolov8n_detection.py on synthetic images, below.
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
DATA = ["--data", str(ROOT.parent / "shared" / "data" / "mnist-mini")]
TINY = ["--val-samples", "64"]
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
    "simclr_mnist": ("simclr_mnist.py", ["--steps", "2", "--batch-size", "8", "--micro-batch-size", "4"]),
    "hf_trainer_resnet": ("hf_trainer_resnet.py", ["--steps", "3", "--batch-size", "8", "--micro-batch-size", "4"]),
    "mmengine_classifier": ("mmengine_classifier.py", ["--steps", "3", "--batch-size", "8", "--micro-batch-size",
                                                       "4"]),
    "mmengine_classifier, count-normalized": (
        "mmengine_classifier.py", ["--steps", "2", "--batch-size", "8", "--micro-batch-size", "4",
                                   "--count-normalized"]),
}


def test_every_example_is_run_by_a_test():
    scripts = {path.name for path in (ROOT / "examples").glob("*.py")}
    assert scripts == {script for script, _ in RUNS.values()} | {"ddp.py", "yolov8n_detection.py"}


@pytest.mark.realtime
@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_example_prints_its_final_metric(run, tmp_path):
    script, args = RUNS[run]
    if "--weights" in args:  # a state dict in the layout torchvision's pretrained files have
        torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet18.pth")
    args = [a.format(tmp=tmp_path) for a in args]
    # bf16_autocast with its default --data, run from another directory: the default lies beside the project
    data = [] if run == "bf16_autocast" else DATA
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *data, *TINY, *args], cwd=tmp_path,
                          env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert not (tmp_path / "shared").exists() and not (tmp_path.parent / "shared").exists()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert not re.search(r"Tip:|deprecated|Warning", output), output[-3000:]  # nothing but the example's own lines
    found = re.search(r"final val_acc (\d\.\d+) on 64 digits", proc.stdout)
    assert found and 0 <= float(found.group(1)) <= 1, proc.stdout[-2000:]
    if "--checkpoint" in args:
        assert (tmp_path / "state" / "optimizer.bin").is_file()


@pytest.mark.realtime
@pytest.mark.slow
def test_yolov8n_example_takes_the_whole_batch_gradient_and_prints_its_loss(tmp_path):
    """Its first step checks itself against a whole-batch forward/backward: accumnorm's gradient is that one (up
    to float32 rounding), plain accumulation's is not."""
    args = ["--steps", "2", "--batch-size", "4", "--micro-batch-size", "2", "--imgsz", "64"]
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "yolov8n_detection.py"), *args], cwd=tmp_path,
                          env=cpu_env(YOLO_OFFLINE="1"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    check = re.search(r"accumnorm (\S+), plain accumulation (\S+)", proc.stdout)
    assert check and float(check.group(1)) < 1e-3 < 1e-2 < float(check.group(2)), proc.stdout[-2000:]
    assert re.search(r"final loss \d+\.\d+ after 2 steps of 4 images in micro-batches of 2", proc.stdout), proc.stdout
