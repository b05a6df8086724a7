"""What keeping a step's saved tensors costs on a GPU: moving them to the host and back, or recomputing them.

A host store sends each saved byte over the host link twice: out in the forward, back in the backward, in
different phases of the step, so a full-duplex link does not halve it. Recomputation runs once more the
forward FLOPs that made what it recomputes. The cheaper is the one that takes less time at the link's
bandwidth and the device's throughput; where neither hides behind the compute, that time adds to the step.
The defaults are achieved figures of a current data-centre GPU, not datasheet peaks: about 50 GB/s each way
over PCIe 5.0 x16 with pinned memory, and about 75 TFLOP/s in bf16 on a convolutional network (a GPU
training resnet50 at 3,000 images/s does 3 x 8.2 GFLOP per image). On such a GPU resnet50 saves 66 MiB per
image under bf16 autocast for 8.2 GFLOP of forward: 2.8 ms of link time against 0.11 ms of recomputation.

Whatever chooses between the two measures the bytes (saved-tensor hooks) and the FLOPs
(`torch.utils.flop_counter.FlopCounterMode`) of what it would move or recompute, and compares
`offload_seconds(bytes)` with `recompute_seconds(flops)`, or asks `offload_is_cheaper`.
"""
from __future__ import annotations

__all__ = ["HOST_LINK_BYTES_PER_S", "DEVICE_FLOPS_PER_S", "offload_seconds", "recompute_seconds",
           "offload_is_cheaper"]

HOST_LINK_BYTES_PER_S = 50e9  # one way, achieved, PCIe 5.0 x16
DEVICE_FLOPS_PER_S = 75e12  # achieved in a training step, bf16


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def offload_seconds(nbytes: float, bandwidth: float = HOST_LINK_BYTES_PER_S) -> float:
    """Seconds the host link takes to move `nbytes` of saved tensors to the host and back, at `bandwidth` bytes
    per second each way."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return 2 * nbytes / _positive("bandwidth", bandwidth)


def recompute_seconds(flops: float, throughput: float = DEVICE_FLOPS_PER_S) -> float:
    """Seconds the device takes to recompute `flops` of forward, at `throughput` FLOP per second."""
    if flops < 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    return flops / _positive("throughput", throughput)


def offload_is_cheaper(nbytes: float, flops: float, bandwidth: float = HOST_LINK_BYTES_PER_S,
                       throughput: float = DEVICE_FLOPS_PER_S) -> bool:
    """Whether moving `nbytes` to the host and back takes less time than recomputing `flops` (module doc)."""
    return offload_seconds(nbytes, bandwidth) < recompute_seconds(flops, throughput)
