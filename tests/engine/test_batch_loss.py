"""Whole-batch losses (`forward_fn` + `batch_loss_fn`) against whole-batch PyTorch, float64, to 1e-9.

The oracle for bn="exact" is plain torch on a twin model: ``L(f(model, whole_batch), targets).backward()``.
For bn="micro" (GradCache's scheme) it is plain torch too: f on each micro-batch in turn (BatchNorm with that
micro-batch's statistics, running statistics updated once per micro-batch), the outputs concatenated, L, one
backward. The losses couple a batch's samples: NT-Xent over two views (SimCLR), a CLIP-style symmetric loss
between two towers with a learnable temperature, a cross-entropy divided by the number of valid targets of the
whole batch, and ultralytics' own YOLOv8 detection loss. A test shows the per-micro-batch form of the same loss
misses the oracle by far, so the oracle can fail.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten, tree_unflatten

import accumnorm
from helpers import assert_unchanged, compare, rel_err, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

DT = torch.float64
TOL = 1e-9
EXACT = ("layerwise", "recompute", "passes", "auto")


# ---------------------------------------------------------------- the oracle, independent of accumnorm's code
def cut(batch: Any, b: int) -> list[Any]:
    """The micro-batches of `b` samples, as a user would cut them: tensors along dim 0, lists as lists."""
    def pieces(field):
        return list(field.split(b)) if isinstance(field, torch.Tensor) else [field[i:i + b]
                                                                             for i in range(0, len(field), b)]
    if isinstance(batch, dict):
        parts = {k: pieces(v) for k, v in batch.items()}
        return [dict(zip(parts, p)) for p in zip(*parts.values())]
    if isinstance(batch, (tuple, list)):
        return [type(batch)(p) for p in zip(*(pieces(v) for v in batch))]
    return pieces(batch)


def cat_outputs(outputs: list[Any]) -> Any:
    flat = [tree_flatten(o) for o in outputs]
    return tree_unflatten([torch.cat(ts) for ts in zip(*(leaves for leaves, _ in flat))], flat[0][1])


def oracle(model: nn.Module, batch, targets, forward_fn, loss_fn, bn: str, b: int) -> torch.Tensor:
    """Plain torch on `model`: bn="exact", one forward of the whole batch; bn="micro", f per micro-batch. One
    backward of the whole batch's loss; returns it."""
    outputs = forward_fn(model, batch) if bn == "exact" else cat_outputs([forward_fn(model, mb)
                                                                         for mb in cut(batch, b)])
    loss = loss_fn(outputs, targets)
    loss.backward()
    return loss.detach()


# ---------------------------------------------------------------- SimCLR: NT-Xent over two augmented views
class SimCLR(nn.Module):
    """A small conv encoder and a projection head with BatchNorm1d; Tanh, no conv bias before BN (smooth, 1e-9)."""

    def __init__(self, drop: nn.Module | None = None, norm=nn.BatchNorm2d) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False), norm(6), nn.Tanh(), drop or nn.Identity(), nn.AvgPool2d(2),
            nn.Conv2d(6, 8, 3, padding=1, bias=False), norm(8), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        head_norm = nn.BatchNorm1d(16) if norm is nn.BatchNorm2d else nn.LayerNorm(16)
        self.head = nn.Sequential(nn.Linear(8, 16, bias=False), head_norm, nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x):
        return self.head(self.encoder(x))


def simclr_forward(model, batch):
    v1, v2 = batch[0], batch[1]
    return model(v1), model(v2)


def nt_xent(outputs, targets=None, tau: float = 0.5) -> torch.Tensor:
    """NT-Xent (SimCLR): each of the 2N embeddings against the other 2N - 1, its other view the positive."""
    z1, z2 = outputs
    n = len(z1)
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = (z @ z.T / tau).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    positives = torch.cat([torch.arange(n) + n, torch.arange(n)])
    return F.cross_entropy(sim, positives)


def views(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 6, 6, generator=g, dtype=DT)
    return (x + 0.3 * torch.randn(x.shape, generator=g, dtype=DT),
            x.flip(-1) + 0.3 * torch.randn(x.shape, generator=g, dtype=DT))


# ---------------------------------------------------------------- CLIP: two towers, images and texts
class CLIP(nn.Module):
    """An image tower and a text tower (texts come as a list of strings), each with BatchNorm, and a learnable
    temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6), nn.Tanh(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 8))
        self.embed = nn.EmbeddingBag(32, 8, mode="mean")
        self.text = nn.Sequential(nn.Linear(8, 12, bias=False), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 8))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))


def clip_forward(model: CLIP, batch):
    texts = batch["text"]
    ids = [torch.tensor([ord(c) % 32 for c in t]) for t in texts]
    offsets = torch.tensor([0] + [len(i) for i in ids[:-1]]).cumsum(0)
    # The temperature reaches the loss through the outputs, one row per sample.
    return {"towers": [model.image(batch["image"]), model.text(model.embed(torch.cat(ids), offsets))],
            "scale": model.logit_scale.expand(len(texts))}


def clip_loss(outputs, targets=None) -> torch.Tensor:
    zi, zt = (F.normalize(z, dim=1) for z in outputs["towers"])
    logits = outputs["scale"][0].exp() * zi @ zt.T
    labels = torch.arange(len(zi))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def image_texts(n: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 5, 5, generator=g, dtype=DT)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    texts = ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (k,), generator=g)) for k in lengths]
    return {"image": images, "text": texts}


# ---------------------------------------------------------------- a loss divided by a count over the whole batch
def segnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.Tanh(),
                         nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.Tanh(), nn.Conv2d(6, 4, 1))


def seg_forward(model, batch):
    logits = model(batch)
    return {"logits": logits, "pred": logits.argmax(1)}  # an integer output: concatenated, no gradient


def masked_ce(outputs, targets) -> torch.Tensor:
    """Cross-entropy over the valid pixels (target != -1) of the whole batch, the misclassified ones weighing
    twice, over the number of valid pixels."""
    ce = F.cross_entropy(outputs["logits"], targets, ignore_index=-1, reduction="none")
    return (ce * (1 + (outputs["pred"] != targets).to(ce.dtype))).sum() / (targets != -1).sum()


def pixels(n: int, seed: int = 3):
    """Images and targets with very different numbers of valid pixels per image (at least one each)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 5, 5, generator=g, dtype=DT)
    y = torch.randint(0, 4, (n, 5, 5), generator=g)
    keep = torch.rand(n, 5, 5, generator=g) < torch.linspace(0.05, 1.0, n).view(n, 1, 1)
    keep[:, 0, 0] = True
    return x, y.masked_fill(~keep, -1)


# ---------------------------------------------------------------- the cases
@dataclass
class Case:
    model: Callable[[], nn.Module]
    data: Callable[[int], tuple[Any, Any]]  # n -> (batch, targets)
    forward_fn: Callable
    loss_fn: Callable
    bn1d: bool  # a BatchNorm1d over (N, C): torch refuses a micro-batch of one sample under bn="micro"


def _model(build):
    def make():
        torch.manual_seed(0)
        return build().to(DT).train()
    return make


class Views(NamedTuple):
    z1: torch.Tensor
    z2: torch.Tensor


def simclr_gn() -> SimCLR:
    """SimCLR without any layer with batch statistics (GroupNorm, LayerNorm): "auto" runs GradCache."""
    return SimCLR(norm=lambda c: nn.GroupNorm(2, c))


CASES = {
    "ntxent": Case(_model(SimCLR), lambda n: (views(n), None), simclr_forward, nt_xent, True),
    "ntxent-gn": Case(_model(simclr_gn), lambda n: (views(n), None), lambda m, b: Views(*simclr_forward(m, b)),
                      nt_xent, False),
    "clip": Case(_model(CLIP), lambda n: (image_texts(n), None), clip_forward, clip_loss, True),
    "masked": Case(_model(segnet), pixels, seg_forward, masked_ce, False),
}


def run_case(case: Case, n: int, b: int, bn: str, schedule: str) -> tuple[nn.Module, nn.Module]:
    """Oracle and accumnorm on twins of the case's model: losses and every gradient and buffer within TOL."""
    ref = case.model()
    ours = copy.deepcopy(ref)
    batch, targets = case.data(n)
    expected = oracle(ref, batch, targets, case.forward_fn, case.loss_fn, bn, b)
    loss = accumnorm.backward(ours, batch, micro_batch_size=b, forward_fn=case.forward_fn,
                              batch_loss_fn=case.loss_fn, targets=targets, bn=bn, schedule=schedule)
    assert rel_err(loss, expected) <= TOL
    compare(ref, ours, TOL)
    return ref, ours


# ---------------------------------------------------------------- 1-3: the losses, every exact schedule and GradCache
@pytest.mark.parametrize("schedule", EXACT)
@pytest.mark.parametrize("name", CASES)
def test_exact_matches_whole_batch(name, schedule):
    """7 samples in micro-batches of 3, 3 and 1: every exact schedule gives whole-batch torch's gradients and
    running statistics (BatchNorm1d over a one-sample micro-batch too: it sees the whole batch)."""
    run_case(CASES[name], 7, 3, "exact", schedule)


@pytest.mark.parametrize("name", CASES)
def test_micro_matches_gradcache_oracle(name):
    """bn="micro": per-micro-batch BatchNorm, the loss over the whole batch; the forward runs twice per
    micro-batch (GradCache), running statistics count once per micro-batch."""
    case, calls = CASES[name], []
    counted = Case(case.model, case.data, lambda m, b: calls.append(1) or case.forward_fn(m, b), case.loss_fn,
                   case.bn1d)
    _, ours = run_case(counted, 8, 3, "micro", "auto")
    assert len(calls) == 3 + 2 * 3  # the oracle's three, then two per micro-batch
    first_bn = next((m for m in ours.modules() if isinstance(m, nn.BatchNorm2d)), None)
    if first_bn is not None:  # once per forward that counts (SimCLR's encoder runs twice a forward, once a view)
        assert first_bn.num_batches_tracked.item() == 3 * (2 if name == "ntxent" else 1)


def test_micro_differs_from_exact():
    """The two bn modes are different computations (their oracles differ), so each comparison means something."""
    case = CASES["ntxent"]
    ref_exact, _ = run_case(case, 8, 4, "exact", "layerwise")
    ref_micro, _ = run_case(case, 8, 4, "micro", "auto")
    assert max(compare(ref_exact, ref_micro, float("inf")).values()) > 1e-3


def test_count_normalized_loss_is_not_plain_accumulation():
    """Masked cross-entropy over the batch's valid pixels: plain accumulation (each micro-batch's own mean over
    its valid pixels, BatchNorm exact all the same) gives another gradient, far off."""
    case = CASES["masked"]
    ref, _ = run_case(case, 6, 2, "exact", "layerwise")
    plain = case.model()
    x, y = pixels(6)
    accumnorm.backward(plain, (x, y), lambda m, b: masked_ce(seg_forward(m, b[0]), b[1]), micro_batch_size=2,
                       bn="exact")
    errs = compare(ref, plain, float("inf"))
    assert max(v for k, v in errs.items() if k.startswith("grad")) > 0.05


def test_ntxent_is_not_a_mean_over_micro_batches():
    """Sanity of the oracle's setup: NT-Xent's whole-batch value differs from the mean of per-micro-batch ones."""
    model = CASES["ntxent"].model()
    batch = views(8)
    with torch.no_grad():
        whole = nt_xent(simclr_forward(model, batch))
        per = torch.stack([nt_xent(simclr_forward(model, mb)) for mb in cut(batch, 4)]).mean()
    assert abs(float(whole - per)) > 0.1


# ---------------------------------------------------------------- 5: the per-micro-batch loss fails the oracle
@pytest.mark.parametrize("schedule", ("layerwise", "recompute", "passes"))
def test_per_micro_batch_ntxent_fails_the_oracle(schedule):
    """Replace the whole-batch NT-Xent by its per-micro-batch mean (the loss_fn form, BatchNorm exact): the
    comparison with the whole-batch oracle fails by far. The tests above can fail."""
    ref = CASES["ntxent"].model()
    ours = copy.deepcopy(ref)
    batch = views(8)
    oracle(ref, batch, None, simclr_forward, nt_xent, "exact", 4)
    accumnorm.backward(ours, batch, lambda m, mb: nt_xent(simclr_forward(m, mb)), micro_batch_size=4,
                       schedule=schedule)
    errs = compare(ref, ours, float("inf"))
    assert max(v for k, v in errs.items() if k.startswith("grad")) > 0.05
    with pytest.raises(AssertionError, match="relative error"):
        compare(ref, ours, TOL)
    # Buffers are the forward's alone: BatchNorm is exact in both, so the running statistics still agree.
    assert max(v for k, v in errs.items() if k.startswith("buffer")) <= TOL


# ---------------------------------------------------------------- auto without norm statistics: GradCache, exact
@pytest.mark.parametrize("norm, forwards", [
    ("group", 2), ("instance", 2),  # no batch or running statistics: GradCache, two forwards per micro-batch
    ("instance, running statistics", 1),  # GradCache's second forward would update them again: layerwise
])
def test_auto_without_norm_statistics_uses_gradcache_and_is_exact(norm, forwards):
    """No layer with batch or running statistics (GroupNorm, InstanceNorm without running statistics, LayerNorm):
    "auto" runs GradCache (two forwards per micro-batch, one micro-batch in memory), exact against the whole batch.
    An InstanceNorm that keeps running statistics goes to layerwise, which updates them once."""
    torch.manual_seed(0)
    model = {"group": lambda: CASES["ntxent-gn"].model(),
             "instance": lambda: SimCLR(norm=lambda c: nn.InstanceNorm2d(c, affine=True)).to(DT),
             "instance, running statistics": lambda: SimCLR(
                 norm=lambda c: nn.InstanceNorm2d(c, affine=True, track_running_stats=True)).to(DT)}[norm]()
    ref, ours, calls = model, copy.deepcopy(model), []
    batch = views(7)
    expected = oracle(ref, batch, None, simclr_forward, nt_xent, "exact", 3)
    loss = accumnorm.backward(ours, batch, micro_batch_size=3, forward_fn=lambda m, b: calls.append(1) or
                              simclr_forward(m, b), batch_loss_fn=nt_xent, schedule="auto")
    assert rel_err(loss, expected) <= TOL
    compare(ref, ours, TOL)
    assert len(calls) == forwards * 3


class FunctionalHead(nn.Module):
    """No norm layer, but a direct F.batch_norm call with batch statistics: "auto" must not run it per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10, bias=False), nn.Tanh(), nn.Linear(10, 10, bias=False))
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(10))
        self.out = nn.Linear(10, 8)

    def forward(self, x):
        return self.out(torch.tanh(F.batch_norm(self.body(x), None, None, self.weight, None, training=True)))


def test_auto_with_functional_batch_norm_goes_exact():
    torch.manual_seed(0)
    model = FunctionalHead().to(DT)
    ref, ours = model, copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    batch = (torch.randn(7, 6, generator=g, dtype=DT), torch.randn(7, 6, generator=g, dtype=DT))
    expected = oracle(ref, batch, None, simclr_forward, nt_xent, "exact", 3)
    loss = accumnorm.backward(ours, batch, micro_batch_size=3, forward_fn=simclr_forward, batch_loss_fn=nt_xent)
    assert rel_err(loss, expected) <= TOL
    compare(ref, ours, TOL)


def test_auto_that_starts_over_in_layerwise_draws_as_layerwise_alone():
    """Dropout before the functional BatchNorm call: "auto" runs GradCache until that call, then starts the step over
    in layerwise. The restart rewinds every micro-batch's random stream, so the step draws (and its gradient is)
    what layerwise alone draws with the same seed, not a stream that GradCache's forward had already advanced."""
    class Dropped(FunctionalHead):
        def forward(self, x):
            return super().forward(F.dropout(x, 0.5, self.training))

    torch.manual_seed(0)
    model = Dropped().to(DT)
    batch = (torch.randn(8, 6, dtype=DT), torch.randn(8, 6, dtype=DT))
    grads = []
    for schedule in ("auto", "layerwise"):
        m = copy.deepcopy(model)
        torch.manual_seed(5)
        accumnorm.backward(m, batch, micro_batch_size=2, forward_fn=simclr_forward, batch_loss_fn=nt_xent,
                           schedule=schedule)
        grads.append([p.grad for p in m.parameters()])
    for auto, layerwise in zip(*grads):
        torch.testing.assert_close(auto, layerwise, rtol=0, atol=0)


# ---------------------------------------------------------------- a learnable temperature the loss closes over
@pytest.mark.parametrize("bn, schedule", [("exact", "passes"), ("micro", "auto"), ("exact", "auto")])
def test_temperature_closed_over_by_the_loss(bn, schedule):
    """A parameter the loss uses itself, not through the outputs (a learnable temperature in a closure), gets its
    gradient under every schedule, those that take the loss's gradient at the outputs first included."""
    ref = CASES["clip"].model()
    ours = copy.deepcopy(ref)
    batch = image_texts(8)

    def forward(m, b):
        out = clip_forward(m, b)
        del out["scale"]
        return out

    def loss_of(model):
        return lambda out, t: clip_loss({**out, "scale": model.logit_scale.expand(len(out["towers"][0]))})

    oracle(ref, batch, None, forward, loss_of(ref), bn, 4)
    accumnorm.backward(ours, batch, micro_batch_size=4, forward_fn=forward, batch_loss_fn=loss_of(ours), bn=bn,
                       schedule=schedule)
    assert ours.logit_scale.grad is not None, "logit_scale got no gradient"
    compare(ref, ours, TOL)


def test_temperature_closed_over_by_the_loss_layerwise():
    """The same closure under layerwise: the loss's graph reaches the parameter, and the gradient is exact."""
    ref = CASES["clip"].model()
    ours = copy.deepcopy(ref)
    batch = image_texts(8)

    def loss_of(model):
        return lambda out, t: clip_loss({**out, "scale": model.logit_scale.expand(len(out["towers"][0]))})

    oracle(ref, batch, None, clip_forward, loss_of(ref), "exact", 4)
    accumnorm.backward(ours, batch, micro_batch_size=4, forward_fn=clip_forward, batch_loss_fn=loss_of(ours),
                       schedule="layerwise")
    compare(ref, ours, TOL)


# ---------------------------------------------------------------- 4: ultralytics' YOLOv8 detection loss
@pytest.fixture
def float64_default():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # v8DetectionLoss makes its loss and padded targets in the default dtype
    yield
    torch.set_default_dtype(dtype)


def yolo_boxes(per_image: list[int], seed: int = 5) -> list[torch.Tensor]:
    """Each image's boxes as rows (cls, x, y, w, h), normalized xywh."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(0, 4, (k, 1), generator=g).double(), 0.25 + 0.5 * torch.rand(k, 2, generator=g),
                       0.15 + 0.35 * torch.rand(k, 2, generator=g)], 1) for k in per_image]


def ultralytics_batch(boxes: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """ultralytics' batch format for its loss: every box of the batch, with the index of its image."""
    rows = torch.cat(boxes)
    idx = torch.cat([torch.full((len(b),), float(i)) for i, b in enumerate(boxes)])
    return {"batch_idx": idx, "cls": rows[:, :1], "bboxes": rows[:, 1:]}


@dataclass
class Yolo:
    model: nn.Module  # as built, no gradient yet
    ref: nn.Module  # after the oracle's whole-batch backward
    expected: torch.Tensor
    images: torch.Tensor
    boxes: list[torch.Tensor]  # each image's boxes
    targets: dict[str, torch.Tensor]  # the batch's boxes in ultralytics' format

    @staticmethod
    def detect(m, x):
        return m(x)  # training mode: {"boxes", "scores", "feats": [3 maps]}, one row per image

    @staticmethod
    def loss(m):
        from ultralytics.utils.loss import v8DetectionLoss  # imported by the fixture, after YOLO_OFFLINE

        criterion = v8DetectionLoss(m)
        return lambda preds, batch: criterion(preds, batch)[0].sum()  # (box, cls, dfl) x batch size, summed


@pytest.fixture(scope="module")
def yolo():
    """ultralytics' YOLOv8n from its yaml (no weights), 4 classes, float64, 6 images of 64 x 64 with 0-3 boxes each,
    and plain torch's whole-batch backward of ultralytics' own v8DetectionLoss."""
    os.environ["YOLO_OFFLINE"] = "1"  # else ultralytics looks up DNS names when imported
    pytest.importorskip("ultralytics", reason="ultralytics is not among accumnorm's extras")
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel
    from ultralytics.utils import LOGGER

    level, dtype = LOGGER.level, torch.get_default_dtype()
    LOGGER.setLevel("WARNING")
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = DetectionModel("yolov8n.yaml", nc=4, verbose=False).to(DT).train()
        model.args = get_cfg()  # the loss gains (box, cls, dfl), as ultralytics' trainer sets them
        images = torch.rand(6, 3, 64, 64, generator=torch.Generator().manual_seed(6), dtype=DT)
        boxes = yolo_boxes([2, 1, 3, 0, 2, 1])
        targets = ultralytics_batch(boxes)
        ref = copy.deepcopy(model)
        expected = oracle(ref, images, targets, Yolo.detect, Yolo.loss(ref), "exact", 2)
    finally:
        LOGGER.setLevel(level)
        torch.set_default_dtype(dtype)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 57
    return Yolo(model, ref, expected, images, boxes, targets)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", EXACT)
def test_yolov8_detection_loss(yolo, schedule, float64_default):
    """ultralytics' own v8DetectionLoss assigns targets over the whole batch and divides by the batch's summed
    target scores: exact under every exact schedule, in micro-batches of 2 (passes: 57 BatchNorm calls, 115
    passes, ~12 s on an idle core)."""
    ours = copy.deepcopy(yolo.model)
    loss = accumnorm.backward(ours, yolo.images, micro_batch_size=2, forward_fn=Yolo.detect,
                              batch_loss_fn=Yolo.loss(ours), targets=yolo.targets, schedule=schedule)
    assert rel_err(loss, yolo.expected) <= TOL
    compare(yolo.ref, ours, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("bn", ("exact", "micro"))
def test_yolov8_plain_accumulation_is_not_exact(yolo, bn, float64_default):
    """Plain accumulation as ultralytics' trainer does it: each micro-batch's loss (x its size, summed over the
    micro-batches), its boxes taken by batch_idx and renumbered; BatchNorm exact or not, far from the oracle."""
    def micro_loss(m, mb):
        x, own_boxes = mb  # the boxes field is a list of per-image tensors, cut as a list
        return Yolo.loss(m)(Yolo.detect(m, x), ultralytics_batch(own_boxes)) * (6 / len(x))  # weighed by len(x)/6

    plain = copy.deepcopy(yolo.model)
    accumnorm.backward(plain, (yolo.images, yolo.boxes), micro_loss, micro_batch_size=2, bn=bn)
    errs = compare(yolo.ref, plain, float("inf"))
    assert max(v for k, v in errs.items() if k.startswith("grad")) > 0.05


# ---------------------------------------------------------------- 6: hypothesis
@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CASES)), n=st.integers(2, 9), data=st.data(),
       schedule=st.sampled_from(EXACT), bn=st.sampled_from(("exact", "micro")))
def test_random_splits(name, n, data, schedule, bn):
    b = data.draw(st.integers(1, n + 1), label="micro_batch_size")
    sizes = [min(b, n - i) for i in range(0, n, b)]
    note(f"micro-batches {sizes}")
    if bn == "micro" and CASES[name].bn1d:
        assume(min(sizes) >= 2)  # torch's BatchNorm1d refuses one sample in training, in the oracle as well
    run_case(CASES[name], n, b, bn, schedule)


# ---------------------------------------------------------------- 7: bad input, nothing changed
MODES = {  # id -> (bn, schedule, model)
    "layerwise": ("exact", "layerwise", "ntxent"),
    "passes": ("exact", "passes", "ntxent"),
    "auto": ("exact", "auto", "ntxent"),
    "micro": ("micro", "auto", "ntxent"),
    "auto-gradcache": ("exact", "auto", "groupnorm"),
}


def prepared(kind: str) -> nn.Module:
    """A model mid-training: running statistics moved, some .grad set and some None."""
    torch.manual_seed(0)
    model = (SimCLR() if kind == "ntxent" else simclr_gn()).to(DT)
    with torch.no_grad():
        model(views(4, seed=9)[0])
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn_like(p) if i % 2 else None
    return model


def refused(mode: str, exc, match: str, *, forward_fn=simclr_forward, batch_loss_fn=nt_xent, n: int = 8,
            **kw) -> str:
    """`accumnorm.backward` raises `exc` matching `match` and changes no .grad, buffer or the caller's RNG; returns
    the message."""
    bn, schedule, kind = MODES[mode]
    model = prepared(kind)
    snap, rng = snapshot(model), torch.get_rng_state()
    with pytest.raises(exc, match=match) as info:
        accumnorm.backward(model, views(n), micro_batch_size=3, forward_fn=forward_fn, batch_loss_fn=batch_loss_fn,
                           bn=bn, schedule=schedule, **kw)
    assert_unchanged(model, snap)
    assert torch.equal(torch.get_rng_state(), rng)
    return str(info.value)


BAD_LOSSES = {
    "non-scalar": (lambda out, t: torch.stack([nt_xent(out)] * 3), ValueError, r"scalar.*shape \(3,\)"),
    "non-tensor": (lambda out, t: nt_xent(out).detach().item(), TypeError,
                   r"scalar Tensor, got float: return the loss tensor itself \(float\(loss\) and loss.item\(\) cut"),
    "integer": (lambda out, t: (nt_xent(out) * 0).long(), TypeError, r"floating-point.*torch.int64"),
    "detached": (lambda out, t: nt_xent(out).detach(), ValueError, r"does not require grad"),
    "non-finite": (lambda out, t: nt_xent(out) * float("inf"), ValueError, r"not finite \(inf\)"),
    "nan": (lambda out, t: nt_xent(out) * float("nan"), ValueError, r"not finite \(nan\)"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", BAD_LOSSES)
def test_bad_batch_loss(what, mode):
    fn, exc, match = BAD_LOSSES[what]
    assert "batch_loss_fn" in refused(mode, exc, match, batch_loss_fn=fn)


def _short_last(f):
    """forward_fn that returns something else for the last micro-batch (2 samples of 3, 3, 2)."""
    return lambda m, b: f(m, b, len(b[0]) < 3)


BAD_OUTPUTS = {
    "width": (_short_last(lambda m, b, last: (lambda z: (z[0], z[1][:, :-1] if last else z[1]))(simclr_forward(m, b))),
              ValueError, r"output \[1\] cannot be concatenated.*micro-batch 2 gave \(2, 7\)"),
    "dtype": (_short_last(lambda m, b, last: (lambda z: (z[0], z[1].float() if last else z[1]))(simclr_forward(m, b))),
              ValueError, r"output \[1\] cannot be concatenated.*torch.float32"),
    "non-tensor leaf": (lambda m, b: (*simclr_forward(m, b), "views"), TypeError,
                        r"output \[2\] must be a Tensor.*got str"),
    "0-dim": (lambda m, b: (*simclr_forward(m, b), m.head[0].weight.sum()), ValueError, r"output \[2\] is 0-dim"),
    "structure": (_short_last(lambda m, b, last: simclr_forward(m, b) if not last else list(simclr_forward(m, b))),
                  ValueError, r"same structure.*micro-batch 2"),
    "dict keys": (_short_last(lambda m, b, last: dict(zip("ac" if last else "ab", simclr_forward(m, b)))),
                  ValueError, r"same structure.*micro-batch 2"),
    "None": (lambda m, b: None, TypeError, r"forward_fn's output must be a Tensor.*got NoneType for micro-batch 0"),
    "no tensor at all": (lambda m, b: (), TypeError, r"forward_fn must return a Tensor, or tuples.*got tuple \(\)"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", BAD_OUTPUTS)
def test_outputs_that_cannot_be_concatenated(what, mode):
    fn, exc, match = BAD_OUTPUTS[what]
    refused(mode, exc, match, forward_fn=fn, batch_loss_fn=lambda out, t: nt_xent(out[:2] if isinstance(out, (
        tuple, list)) else tuple(out.values())))


@pytest.mark.parametrize("mode", MODES)
def test_failing_batch_loss_fn_changes_nothing(mode):
    def fails(out, t):
        nt_xent(out).backward(retain_graph=True) if torch.is_grad_enabled() and out[0].requires_grad else None
        raise KeyError("no such target")

    refused(mode, KeyError, "no such target", batch_loss_fn=fails)


@pytest.mark.parametrize("mode", MODES)
def test_failing_forward_fn_changes_nothing(mode):
    def fails(m, b):
        out = simclr_forward(m, b)
        if len(b[0]) < 3:
            raise RuntimeError("bad micro-batch")
        return out

    refused(mode, RuntimeError, "bad micro-batch", forward_fn=fails)


def test_targets_rows_must_match_the_batch():
    refused("layerwise", ValueError, r"targets is 5 rows, but the batch has 8 samples", targets=torch.zeros(5))
    refused("layerwise", ValueError, r"targets is a 0-dim tensor", targets=torch.tensor(1.0))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(loss_fn=lambda m, b: nt_xent(simclr_forward(m, b)), forward_fn=simclr_forward, batch_loss_fn=nt_xent),
     TypeError, "either loss_fn .* or forward_fn and batch_loss_fn"),
    (dict(forward_fn=simclr_forward), TypeError, "batch_loss_fn must be callable.*got NoneType"),
    (dict(batch_loss_fn=nt_xent), TypeError, "forward_fn must be callable.*got NoneType"),
    (dict(forward_fn=simclr_forward, batch_loss_fn="nt_xent"), TypeError, "batch_loss_fn must be callable.*got str"),
    (dict(loss_fn=lambda m, b: nt_xent(simclr_forward(m, b)), targets=torch.zeros(8)), TypeError,
     "targets go to batch_loss_fn"),
    (dict(), TypeError, "loss_fn must be callable"),
], ids=["both", "forward_fn alone", "batch_loss_fn alone", "batch_loss_fn not callable", "targets with loss_fn",
        "neither"])
def test_objective_arguments(kwargs, exc, match):
    model = prepared("ntxent")
    snap = snapshot(model)
    loss_fn = kwargs.pop("loss_fn", None)
    with pytest.raises(exc, match=match):
        accumnorm.backward(model, views(8), loss_fn, micro_batch_size=3, **kwargs)
    assert_unchanged(model, snap)


def test_process_group_with_batch_loss_fn():
    """A real ProcessGroup object (built on a HashStore: torch.distributed itself is not initialized)."""
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)
    refused("layerwise", ValueError, "batch_loss_fn with a process_group is not supported", process_group=group)
    assert not dist.is_initialized()


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_loss_under_grad_scaler_is_left_to_the_scaler(mode):
    """With a GradScaler an overflow is the scaler's business: the step finishes, the gradients are not finite,
    the scaler skips the optimizer step and halves its scale."""
    bn, schedule, kind = MODES[mode]
    model = prepared(kind)
    for p in model.parameters():
        p.grad = None
    params = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    loss = accumnorm.backward(model, views(8), micro_batch_size=3, forward_fn=simclr_forward,
                              batch_loss_fn=lambda out, t: nt_xent(out) * float("inf"), bn=bn, schedule=schedule,
                              grad_scaler=scaler)
    assert not torch.isfinite(loss)
    assert not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert scaler.get_scale() == 8.0


def test_grad_scaler_scales_the_whole_batch_loss():
    """A finite loss under a GradScaler: gradients are the oracle's times the scale."""
    ref = CASES["ntxent"].model()
    ours = copy.deepcopy(ref)
    batch = views(7)
    expected = oracle(ref, batch, None, simclr_forward, nt_xent, "exact", 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    loss = accumnorm.backward(ours, batch, micro_batch_size=3, forward_fn=simclr_forward, batch_loss_fn=nt_xent,
                              grad_scaler=scaler)
    assert rel_err(loss, expected) <= TOL
    for p in ours.parameters():
        p.grad /= 4.0
    compare(ref, ours, TOL)


# ---------------------------------------------------------------- 8: random numbers
class RecordedDropout(nn.Module):
    """Dropout drawing its mask from torch's generator and recording it by (first sample, view); or replaying."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.p, self.key = p, None
        self.drawn: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.replay: dict[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x):
        key = self.key
        mask = self.replay[key] if self.replay is not None else (torch.rand_like(x) >= self.p).to(x.dtype)
        self.drawn.setdefault(key, []).append(mask)
        return x * mask / (1 - self.p)


def dropout_forward(model, batch):
    """Each view through the model, the dropout told which micro-batch and view it sees (by its first sample:
    under layerwise the micro-batches' forwards interleave, but each sets the key just before its own call)."""
    v1, v2, index = batch
    drop = model.encoder[3]
    outs = []
    for view, v in enumerate((v1, v2)):
        h = model.encoder[:3](v)
        drop.key = (int(index[0]), view)
        outs.append(model.head(model.encoder[4:](drop(h))))
    return tuple(outs)


def dropout_model(kind: str) -> SimCLR:
    torch.manual_seed(0)
    norm = nn.BatchNorm2d if kind == "ntxent" else (lambda c: nn.GroupNorm(2, c))
    return SimCLR(drop=RecordedDropout(), norm=norm).to(DT)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_masks_replay_and_gradients_are_exact(mode):
    """Every forward of a micro-batch (GradCache's two, passes' 2L + 1) draws the same masks; with those masks
    replayed, plain torch's oracle gives the same gradients; the same seed gives bit-identical gradients."""
    bn, schedule, kind = MODES[mode]
    n, b = 8, 3
    batch = (*views(n), torch.arange(n))
    runs = []
    for _ in range(2):
        model = dropout_model(kind)
        torch.manual_seed(123)
        accumnorm.backward(model, batch, micro_batch_size=b, forward_fn=dropout_forward, batch_loss_fn=nt_xent,
                           bn=bn, schedule=schedule)
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p.grad, q.grad)
    drawn = runs[0].encoder[3].drawn
    assert drawn.keys() == {(start, view) for start in range(0, n, b) for view in (0, 1)}
    forwards = {"micro": 2, "auto-gradcache": 2, "layerwise": 1, "auto": 1}.get(mode)  # passes: 2L + 2 at most
    for key, masks in drawn.items():
        assert forwards is None or len(masks) == forwards, key
        assert all(torch.equal(m, masks[0]) for m in masks), f"micro-batch {key}: its forwards drew other masks"
    assert not any(torch.equal(drawn[(0, 0)][0], m[0]) for k, m in drawn.items() if k != (0, 0))  # fresh masks

    ref = dropout_model(kind)
    drop = ref.encoder[3]
    if bn == "exact":  # the whole batch in one forward: its mask is the micro-batches' masks in order
        drop.replay = {(0, view): torch.cat([drawn[(s, view)][0] for s in range(0, n, b)]) for view in (0, 1)}
    else:
        drop.replay = {key: masks[0] for key, masks in drawn.items()}
    oracle(ref, batch, None, dropout_forward, nt_xent, bn, b)
    compare(ref, runs[0], TOL)


def test_a_batch_loss_that_draws_draws_the_same_whatever_the_split():
    """batch_loss_fn sees the whole batch's outputs whatever the split: what it draws, from the step's own stream, is
    the same at any micro-batch size and under every exact schedule, given the caller's seed (its stream was seeded
    from the number of micro-batches)."""
    def noisy_nt_xent(outputs, targets=None):
        z1, z2 = outputs
        return nt_xent((z1 + 0.1 * torch.randn_like(z1), z2), targets)

    losses: dict[str, list[torch.Tensor]] = {}
    for bn, schedule, kind in MODES.values():
        if bn != "exact":  # each micro-batch's own statistics: the outputs themselves depend on the split
            continue
        for b in (2, 3, 8):
            model = prepared(kind)
            torch.manual_seed(7)
            losses.setdefault(kind, []).append(accumnorm.backward(
                model, views(8), micro_batch_size=b, forward_fn=simclr_forward, batch_loss_fn=noisy_nt_xent,
                schedule=schedule))
    for kind, found in losses.items():
        for loss in found[1:]:
            torch.testing.assert_close(loss, found[0], rtol=1e-12, atol=0, msg=kind)


def test_caller_rng_advances_the_same_whatever_the_split():
    """One draw of the caller's generator per step, whatever the micro-batch size, bn mode and schedule."""
    after = set()
    for bn, schedule, kind in MODES.values():
        for b in (2, 3, 8):
            model = prepared(kind)
            torch.manual_seed(7)
            accumnorm.backward(model, views(8), micro_batch_size=b, forward_fn=simclr_forward,
                               batch_loss_fn=nt_xent, bn=bn, schedule=schedule)
            after.add(torch.rand(()).item())
    assert len(after) == 1


def _head_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5), nn.BatchNorm1d(5)).double()


def test_a_batch_norm_in_batch_loss_fn_is_torchs_over_the_whole_batch(schedule_any):
    """batch_loss_fn sees the whole batch's outputs: a batch norm there normalizes the whole batch, as torch's does.
    Passes ran it under the step's mode, which took it for a call of a pass: its internal StopPass escaped the step,
    an exception with no message."""
    ref = _head_net()
    ours = copy.deepcopy(ref)
    x, t = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 5, (10,))

    def loss(out, targets):
        return F.cross_entropy(F.batch_norm(out, None, None, training=True), targets)

    expected = loss(ref(x), t)
    expected.backward()
    got = accumnorm.backward(ours, x, micro_batch_size=4, forward_fn=lambda m, xs: m(xs), batch_loss_fn=loss,
                             targets=t, schedule=schedule_any)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=0)
    compare(ref, ours, 1e-10)


def test_a_layer_of_the_model_run_in_batch_loss_fn_is_refused_naming_it(schedule_any):
    """The model's own BatchNorm layer run again in batch_loss_fn: the step counts every training forward of its
    layers, and cannot count this one. Refused under every schedule with a message that says where it ran (passes
    let its StopPass escape), nothing changed."""
    model = _head_net()
    x, t = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 5, (10,))
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"BatchNorm1d 4.*\(in batch_loss_fn\).*Nothing was changed"):
        accumnorm.backward(model, x, micro_batch_size=4, forward_fn=lambda m, xs: m[:4](xs),
                           batch_loss_fn=lambda out, targets: F.cross_entropy(model[4](out), targets), targets=t,
                           schedule=schedule_any)
    assert_unchanged(model, snap)


def test_an_instance_norm_with_running_statistics_in_batch_loss_fn_moves_them_once(schedule_any):
    """An InstanceNorm that keeps running statistics, run in batch_loss_fn over the whole batch's outputs: torch's call
    moves them once. Passes took it for a call of its own and left them unmoved, silently."""
    ref = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).double()
    norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True).double()
    ours, our_norm = copy.deepcopy(ref), copy.deepcopy(norm)
    x, t = torch.randn(8, 1, 6, 6, dtype=torch.float64), torch.randn(8, 4, 4, 4, dtype=torch.float64)

    def loss_of(n):
        return lambda out, targets: (n(out) - targets).square().mean()

    expected = loss_of(norm)(ref(x), t)
    expected.backward()
    got = accumnorm.backward(ours, x, micro_batch_size=4, forward_fn=lambda m, xs: m(xs),
                             batch_loss_fn=loss_of(our_norm), targets=t, schedule=schedule_any)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=0)
    compare(ref, ours, 1e-10)
    for name, want in norm.state_dict().items():
        torch.testing.assert_close(our_norm.state_dict()[name], want, rtol=1e-12, atol=1e-15, msg=name)
    torch.testing.assert_close(our_norm.weight.grad, norm.weight.grad, rtol=1e-10, atol=1e-14)


class InstanceNormed(nn.Module):
    """A net with an InstanceNorm layer that tracks running statistics, which its batch_loss_fn calls again."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)
        self.inorm = nn.InstanceNorm1d(3, track_running_stats=True, momentum=0.3)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(self.inorm(self.conv(x)).pow(2).mean(2))


def _instance_normed_loss(model: InstanceNormed) -> Callable:
    def loss(outputs, targets):  # the model's layer over the whole batch's outputs, then a read of what it moved
        spread = model.inorm(outputs.view(-1, 1, 2).expand(-1, 3, 2) * torch.tensor([1.0, 2.0], dtype=outputs.dtype))
        return F.mse_loss(outputs, targets) + spread.pow(2).mean() + model.inorm.running_var.sum() * outputs.mean()
    return loss


@pytest.mark.parametrize("schedule", ["layerwise", "passes"])
def test_an_instance_norm_in_batch_loss_fn_moves_its_running_statistics_once_after_the_forwards(schedule):
    """Under passes, an InstanceNorm call in batch_loss_fn moved the running statistics in place, and the step then
    put them back as before it: the move was lost (running_var 0.22 off after one step, the next steps' losses and
    gradients wrong, silently). It is now noted after the forwards' calls, and found moved by a read after it."""
    ref = InstanceNormed().double()
    ours = copy.deepcopy(ref)
    x, y = torch.randn(10, 2, 5, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    for step in range(3):
        ref.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        expected = _instance_normed_loss(ref)(ref(x + step), y)
        expected.backward()
        loss = accumnorm.backward(ours, x + step, micro_batch_size=3, forward_fn=lambda m, b: m(b),
                                  batch_loss_fn=_instance_normed_loss(ours), targets=y, schedule=schedule)
        assert rel_err(loss, expected) < 1e-12
        compare(ref, ours, 1e-9)


class OneMoreCall(nn.Module):
    """A net whose forward makes one more batch-statistics call (a BatchNorm, or an InstanceNorm that tracks running
    statistics) for a batch holding a marked sample."""

    def __init__(self, more: nn.Module) -> None:
        super().__init__()
        self.conv, self.bn, self.more, self.fc = nn.Conv1d(2, 3, 3, padding=1), nn.BatchNorm1d(3), more, nn.Linear(3, 2)

    def forward(self, x):
        h = self.bn(self.conv(x))
        return self.fc((self.more(h) if (x[:, 0, 0] > 100).any() else h).mean(2))


@pytest.mark.parametrize("more", [nn.BatchNorm1d(3), nn.InstanceNorm1d(3, track_running_stats=True)],
                         ids=["batch_norm", "instance_norm"])
def test_passes_refuses_a_micro_batch_with_one_more_call_than_the_first_under_a_whole_batch_loss(more):
    """Under passes with a whole-batch loss, the forwards that give the loss's outputs took a call past micro-batch
    0's last for a new one: a BatchNorm's was refused as a count of calls off by one in another micro-batch, an
    InstanceNorm's reached batch_loss_fn as a forward's output that was no tensor. Each is refused at the call now,
    naming the micro-batch and the call, with nothing changed."""
    model = OneMoreCall(more).double()
    x, y = torch.randn(9, 2, 5, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)
    x[4, 0, 0] = 200.0
    snap = snapshot(model)
    with pytest.raises(ValueError, match=f"micro-batch 1 made {type(more).__name__[:-2]} call "):
        accumnorm.backward(model, x, micro_batch_size=3, forward_fn=lambda m, b: m(b), batch_loss_fn=F.mse_loss,
                           targets=y, schedule="passes")
    assert_unchanged(model, snap)
