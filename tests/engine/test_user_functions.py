"""What a step asks of the user's functions, held under every exact schedule: each case is exact against whole-batch
PyTorch, or refused with a clear error before anything changes.

- Cases the passes schedule ("auto" falls back to it) used to get wrong or fail on with torch's own errors: a
  batch norm with a bias and no weight, full backward hooks, a loss_fn that differentiates, enables grad, hooks
  tensors or calls a custom Function, an empty piece of a batch-norm input, a forward under no_grad.
- The whole-batch loss's contract: one row per sample in every output tensor, and outputs that reach the model.
- A backward inside loss_fn through a BatchNorm call the micro-batches meet at, which has no whole-batch meaning.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm
from helpers import (
    EXACT_SCHEDULES,
    assert_ranks_ended_well,
    assert_unchanged,
    ce_loss,
    compare,
    launch_ranks,
    rel_err,
    snapshot,
    whole_batch,
)
from models import affine_batch, affine_net, blocks_net, reads_running_net

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
              pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")]

DT = torch.float64


class Net(nn.Module):
    """Linear-BN-Tanh twice, then a linear head; `features` is everything below the head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(),
                                      nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x))


def batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 6, generator=g, dtype=DT), torch.tensor([0, 1, 2, 3] * (n // 4))


def exact_or_refused(model: nn.Module, loss_fn: Callable, schedule: str, refusal: str | None, micro: int = 2,
                     data=None, tol: float = 1e-9) -> None:
    """accumnorm.backward on a copy of `model` against whole-batch torch on another: the loss, every gradient and
    buffer within `tol`; or, with `refusal`, a ValueError/TypeError matching it and nothing changed."""
    data = batch() if data is None else data
    ours = copy.deepcopy(model)
    if refusal is not None:
        snap, rng = snapshot(ours), torch.get_rng_state()
        with pytest.raises((ValueError, TypeError), match=refusal):
            accumnorm.backward(ours, data, loss_fn, micro_batch_size=micro, schedule=schedule)
        assert_unchanged(ours, snap)
        assert torch.equal(torch.get_rng_state(), rng)
        return
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, data, loss_fn)
    loss = accumnorm.backward(ours, data, loss_fn, micro_batch_size=micro, schedule=schedule)
    assert rel_err(loss, expected) <= tol
    compare(ref, ours, tol)


# ---------------------------------------------------------------- class 3: what passes used to get wrong
class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return 2 * a * g


def input_gradient_above_the_batch_norms(m, b):
    """A penalty on the gradient at the head's input: a backward inside loss_fn that meets no BatchNorm call."""
    h = m.features(b[0])
    out = m.head(h)
    (g,) = torch.autograd.grad(out.pow(2).sum(), h, create_graph=True)
    return F.cross_entropy(out, b[1]) + 0.1 * g.pow(2).sum(1).mean()


def enables_grad(m, b):
    with torch.enable_grad():
        return ce_loss(m, b)


def hooks_its_output(m, b):
    out = m(b[0])
    out.register_hook(lambda g: 2 * g)
    return F.cross_entropy(out, b[1])


def hooks_its_features(m, b):
    h = m.features[:2](b[0])
    h.register_hook(lambda g: g * torch.linspace(0.5, 1.5, g.shape[1], dtype=g.dtype))
    return F.cross_entropy(m.head(m.features[2:](h)), b[1])


class ClampedGradient(torch.autograd.Function):
    """The identity, whose backward clamps the gradient: a backward that is not linear in its gradient."""

    @staticmethod
    def forward(ctx, a):
        return a.view_as(a)

    @staticmethod
    def backward(ctx, g):
        return g.clamp(-2e-3, 2e-3)


def _clamped_below_the_batch_norms(clamp: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A loss_fn whose gradient at the first BatchNorm's input is clamped by `clamp(input)`: passes and segments add
    that call's backward in two parts (a correction after the rest), and a clamp of each part is not a clamp of the
    sum (off by 1.1 under passes, 0.2 under segments, without a word)."""
    def loss_fn(m, b):
        h = clamp(m.features[0](b[0]))
        return F.cross_entropy(m.head(m.features[1:](h)), b[1])
    return loss_fn


def _tensor_hook(h: torch.Tensor) -> torch.Tensor:
    h.register_hook(lambda g: g.clamp(-2e-3, 2e-3))
    return h


def clamped_by_a_pre_hook() -> nn.Module:
    model = net()
    model.features[0].register_full_backward_pre_hook(lambda mod, go: (go[0].clamp(-2e-3, 2e-3),))
    return model


def custom_function_on_the_output(m, b):
    return F.cross_entropy(Square.apply(m(b[0])), b[1])


def custom_function_between_batch_norms(m, b):
    h = Square.apply(m.features[:3](b[0]))
    return F.cross_entropy(m.head(m.features[3:](h)), b[1])


def selected(m, b):
    """The loss of the samples of class 3, normalized by the micro-batch's size: micro-batches of 2 of the batch
    [0, 1, 2, 3, ...] hold none in every other one, whose batch-norm pieces are empty."""
    x, y = b
    keep = y == 3
    out = m.head(m.features(x[keep]))
    return out.pow(2).sum() / len(y)


def frozen_features_under_no_grad(m, b):
    """The features in training mode but under no_grad (a frozen backbone whose statistics still move)."""
    with torch.no_grad():
        h = m.features(b[0])
    return F.cross_entropy(m.head(h), b[1])


def teacher_under_no_grad(m, b):
    with torch.no_grad():
        target = m(b[0].flip(-1)).softmax(-1)
    return F.cross_entropy(m(b[0]), target)


def zeroes_the_gradients(m, b):
    """A closure ported as it was: zero_grad, then the loss. Under passes, a later pass's forward cleared what the
    earlier passes' backwards had made (off by the gradient's size, without a word): the step's forwards now find
    .grad as the whole batch's one forward does, before any backward of the step."""
    m.zero_grad(set_to_none=False)
    return ce_loss(m, b)


def clips_the_gradients(m, b):
    """A clip in loss_fn: nothing to clip before the whole batch's backward; under passes it cut the passes' gradients
    made so far."""
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    return ce_loss(m, b)


def _scaled_grad_input(module, grad_input, grad_output):
    return tuple(None if g is None else 0.5 * g for g in grad_input)


def with_hook(where: str, kind: str = "full") -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = Net().to(DT)
        m = model.get_submodule(where) if where else model
        if kind == "pre":
            m.register_full_backward_pre_hook(lambda mod, go: (go[0] * 0.5,))
        elif kind == "legacy":
            m.register_backward_hook(_scaled_grad_input)
        else:
            m.register_full_backward_hook(_scaled_grad_input)
        return model
    return build


def net() -> nn.Module:
    torch.manual_seed(0)
    return Net().to(DT)


PASSES_CASES = {  # name: (model, loss_fn, micro-batch size, refusal or None)
    "bias without weight, weight without bias": (affine_net, ce_loss, 2, None),
    "full backward hook on the first BatchNorm": (with_hook("features.1"), ce_loss, 2, None),
    "full backward hook on the second BatchNorm": (with_hook("features.4"), ce_loss, 2, None),
    "full backward hook on the module making the calls": (with_hook("features"), ce_loss, 2, None),
    "full backward hook on the model": (with_hook(""), ce_loss, 2, None),
    "full backward hook on a layer below": (with_hook("features.0"), ce_loss, 2, None),
    "full backward pre-hook on a BatchNorm": (with_hook("features.1", "pre"), ce_loss, 2, None),
    "register_backward_hook on a BatchNorm": (with_hook("features.4", "legacy"), ce_loss, 2,
                                              r"register_backward_hook on BatchNorm1d features\.4.*Nothing was "
                                              r"changed. Use register_full_backward_hook"),
    "register_backward_hook on a Linear": (with_hook("features.3", "legacy"), ce_loss, 2, None),
    "loss_fn differentiates inside": (net, input_gradient_above_the_batch_norms, 2, None),
    "loss_fn enables grad": (net, enables_grad, 2, None),
    "loss_fn hooks its output": (net, hooks_its_output, 2, None),
    "loss_fn hooks an inner tensor": (net, hooks_its_features, 2, None),
    "custom Function on the output": (net, custom_function_on_the_output, 2, None),
    "custom Function between BatchNorms": (net, custom_function_between_batch_norms, 2, None),
    "loss_fn zeroes the gradients": (net, zeroes_the_gradients, 2, None),
    "loss_fn clips the gradients": (net, clips_the_gradients, 2, None),
    "a tensor hook clamps a gradient below the BatchNorms": (net, _clamped_below_the_batch_norms(_tensor_hook), 2,
                                                              None),
    "a custom Function clamps a gradient below the BatchNorms": (
        net, _clamped_below_the_batch_norms(ClampedGradient.apply), 2, None),
    "a full backward pre-hook clamps a gradient below the BatchNorms": (clamped_by_a_pre_hook, ce_loss, 2, None),
    "empty masked piece": (net, selected, 2, None),
    "frozen features under no_grad": (net, frozen_features_under_no_grad, 2, None),
    "frozen features under no_grad, one micro-batch": (net, frozen_features_under_no_grad, 8, None),
    "a teacher forward under no_grad": (net, teacher_under_no_grad, 2, None),
    "a teacher forward under no_grad, one micro-batch": (net, teacher_under_no_grad, 8, None),
}


@pytest.mark.parametrize("case", PASSES_CASES)
def test_what_passes_used_to_miss_is_exact(schedule, case):
    build, loss_fn, micro, refusal = PASSES_CASES[case]
    exact_or_refused(build(), loss_fn, schedule, refusal, micro, data=affine_batch() if build is affine_net else None)


class TwoCalls(nn.Module):
    """A residual block of two conv-BatchNorm pairs: a region of segments with two calls, the lower of which gets its
    backward in two parts (a correction)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))


class TwoCallBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[TwoCalls() for _ in range(4)])
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))


@pytest.mark.parametrize("kind", ["tensor hook", "custom Function", "full backward pre-hook"])
def test_a_clamped_gradient_inside_a_region_is_exact(schedule, kind):
    """A clamp of the gradient at each block's first BatchNorm input, inside segments' regions: segments added that
    call's backward in two parts, each clamped (0.2 off, without a word). Now every call there gets its sums first."""
    torch.manual_seed(0)
    model = TwoCallBlocks().to(DT)
    for block in model.blocks:
        if kind == "tensor hook":
            block.conv1.register_forward_hook(lambda mod, args, out: _tensor_hook(out))
        elif kind == "custom Function":
            block.conv1.register_forward_hook(lambda mod, args, out: ClampedGradient.apply(out))
        else:
            block.conv1.register_full_backward_pre_hook(lambda mod, go: (go[0].clamp(-2e-3, 2e-3),))
    g = torch.Generator().manual_seed(0)
    data = torch.randn(10, 4, 6, 6, generator=g, dtype=DT), torch.randint(0, 4, (10,), generator=g)
    exact_or_refused(model, ce_loss, schedule, None, 4, data=data)


@pytest.mark.parametrize("full", [True, False])
def test_a_global_backward_hook_is_exact_or_refused(schedule, full):
    module = nn.modules.module
    register = module.register_module_full_backward_hook if full else module.register_module_backward_hook
    kind_before = module._global_is_full_backward_hook  # torch keeps the kind after the last hook goes
    handle = register(_scaled_grad_input)
    try:
        exact_or_refused(net(), ce_loss, schedule, None if full else r"register_module_backward_hook on the model's "
                         r"BatchNorm layers.*Nothing was changed. Use register_module_full_backward_hook")
    finally:
        handle.remove()
        module._global_is_full_backward_hook = kind_before


@pytest.mark.parametrize("net", ["affine", "reads-running", "uneven"])
def test_two_ranks_are_the_whole_batch(tmp_path, net):
    """tests/programs/affine_ranks.py: two gloo ranks, each with half the batch, under each exact schedule, give the
    whole batch's loss, gradients and buffers: `AffineHalves` (a bias without a weight among its calls), and
    `ReadsRunning`, whose eval-mode call after its BatchNorm's reads the running statistics that call moved (across
    ranks they used to move at the step's end, so the read found them as before the step). `uneven`: blocks that
    recompute and segments make regions, 3 micro-batches on one rank and 1 on the other (a rank with one micro-batch
    ran segments' regions as they are, and the ranks' collectives went apart: gloo aborted)."""
    program = Path(__file__).parents[1] / "programs" / "affine_ranks.py"
    assert_ranks_ended_well(launch_ranks([str(program), str(tmp_path), net], tmp_path))
    build = {"affine": affine_net, "reads-running": reads_running_net, "uneven": blocks_net}[net]
    ref = build()
    expected = whole_batch(ref, affine_batch())
    for schedule in EXACT_SCHEDULES:
        for rank in range(2):
            got = torch.load(tmp_path / f"{schedule}-{rank}.pt")
            assert rel_err(got["loss"], expected) < 1e-12
            model = build()
            for p, g in zip(model.parameters(), got["grads"].values()):
                p.grad = g
            model.load_state_dict({**model.state_dict(), **got["buffers"]})
            compare(ref, model, 1e-9)


# ---------------------------------------------------------------- class 4: the whole-batch loss's contract
class GroupNormNet(nn.Module):
    """No batch statistics: under "auto" its whole-batch loss runs one micro-batch at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(6, 8), nn.GroupNorm(2, 8), nn.Tanh())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x))


def ce_of(out, targets):
    return F.cross_entropy(out, targets)


def one_view_each(m, b):
    return m(b[0])


def two_views(m, b):
    return torch.cat([m(b[0]), m(b[0].flip(-1))])


def two_views_stacked(m, b):
    return torch.stack([m(b[0]), m(b[0].flip(-1))], 1)


def pair_loss(out, targets):
    return F.cross_entropy(out[:, 0], targets) + F.cross_entropy(out[:, 1], targets)


BATCH_LOSS_CASES = {  # name: (forward_fn, batch_loss_fn, refusal or None)
    "one row per sample": (one_view_each, ce_of, None),
    "two views stacked along dim 1": (two_views_stacked, pair_loss, None),
    "one of two outputs detached": (lambda m, b: (m(b[0]), m(b[0].flip(-1)).detach()),
                                    lambda out, t: ce_of(out[0], t) + out[1].pow(2).mean(), None),
    "two rows per sample": (two_views, lambda out, t: ce_of(out, t.repeat(2)),
                            r"output has 4 rows \(shape \(4, 10\)\) for micro-batch 0 of 2 samples.*one row per"),
    "a statistic of the micro-batch": (lambda m, b: (m(b[0]), m(b[0]).mean(0, keepdim=True)),
                                       lambda out, t: ce_of(out[0], t) + out[1].pow(2).mean(),
                                       r"output \[1\] has 1 rows.*micro-batch 0 of 2 samples"),
    "every other row": (lambda m, b: m(b[0])[::2], lambda out, t: ce_of(out, t[::2]),
                        r"output has 1 rows.*micro-batch 0 of 2 samples"),
    "transposed": (lambda m, b: m(b[0]).T, lambda out, t: out.pow(2).mean(), r"output has 10 rows.*of 2 samples"),
    "a dict field of two rows per sample": (lambda m, b: {"logits": m(b[0]), "both": two_views(m, b)},
                                            lambda out, t: ce_of(out["logits"], t) + out["both"].pow(2).mean(),
                                            r"output \['both'\] has 4 rows"),
    "a list of per-sample items": (lambda m, b: [row.repeat(i + 2, 1) for i, row in enumerate(m(b[0]))],
                                   lambda out, t: sum(o.pow(2).mean() for o in out), r"output \[1\] has 3 rows"),
    "detached output": (lambda m, b: m(b[0]).detach(), ce_of, r"batch_loss_fn's loss does not require grad"),
    "output under no_grad": (lambda m, b: torch.no_grad()(m)(b[0]), ce_of, r"batch_loss_fn's loss does not requ"),
    "output's .data": (lambda m, b: m(b[0]).data, ce_of, r"batch_loss_fn's loss does not require grad"),
    "every output detached": (lambda m, b: (m(b[0]).detach(), m(b[0].flip(-1)).detach()),
                              lambda out, t: ce_of(out[0], t) + ce_of(out[1], t), r"loss does not require grad"),
}


def batch_loss_exact_or_refused(model: nn.Module, case: str, **kwargs) -> None:
    """accumnorm.backward with the case's forward_fn and batch_loss_fn against whole-batch torch (forward_fn over the
    whole batch, batch_loss_fn of that); or refused, with nothing changed."""
    forward_fn, batch_loss_fn, refusal = BATCH_LOSS_CASES[case]
    (x, y), ours = batch(), copy.deepcopy(model)
    run = dict(micro_batch_size=2, forward_fn=forward_fn, batch_loss_fn=batch_loss_fn, targets=y, **kwargs)
    if refusal is not None:
        snap, rng = snapshot(ours), torch.get_rng_state()
        with pytest.raises(ValueError, match=refusal):
            accumnorm.backward(ours, (x,), **run)
        assert_unchanged(ours, snap)
        assert torch.equal(torch.get_rng_state(), rng)
        return
    ref = copy.deepcopy(model)
    expected = batch_loss_fn(forward_fn(ref, (x,)), y)
    expected.backward()
    loss = accumnorm.backward(ours, (x,), **run)
    assert rel_err(loss, expected) <= 1e-9
    compare(ref, ours, 1e-9)


@pytest.mark.parametrize("norm", ["batch", "group"])
@pytest.mark.parametrize("case", BATCH_LOSS_CASES)
def test_the_whole_batch_loss_contract(schedule, case, norm):
    batch_loss_exact_or_refused(net() if norm == "batch" else GroupNormNet().to(DT), case, schedule=schedule)


@pytest.mark.parametrize("case", [c for c, (_, _, refusal) in BATCH_LOSS_CASES.items() if refusal is not None])
def test_the_whole_batch_loss_contract_one_micro_batch_at_a_time(case):
    """The same refusals where the micro-batches run one at a time: "auto" without batch statistics (exact)."""
    torch.manual_seed(0)
    batch_loss_exact_or_refused(GroupNormNet().to(DT), case, schedule="auto")


# ---------------------------------------------------------------- class 5: a backward inside loss_fn through a met call
def aux_backward(m, b):
    out = m(b[0])
    out.pow(2).mean().backward(retain_graph=True)
    return F.cross_entropy(out, b[1])


def gradient_penalty(m, b):
    x = b[0].clone().requires_grad_()
    out = m(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return F.cross_entropy(out, b[1]) + g.pow(2).sum(1).mean()


def saliency(m, b):
    """A gradient read without a graph, to weigh the samples."""
    x = b[0].clone().requires_grad_()
    out = m(x)
    (g,) = torch.autograd.grad(out.logsumexp(1).sum(), x, retain_graph=True)
    weights = g.norm(dim=1) / g.norm(dim=1).sum()
    return (F.cross_entropy(out, b[1], reduction="none") * weights.detach()).sum()


def backward_below_the_second_batch_norm(m, b):
    h = m.features[:3](b[0])
    h.pow(2).mean().backward(retain_graph=True)
    return F.cross_entropy(m.head(m.features[3:](h)), b[1])


def backward_into_chosen_inputs(m, b):
    out = m(b[0])
    torch.autograd.backward(out.pow(2).mean(), inputs=[m.features[0].weight], retain_graph=True)
    return F.cross_entropy(out, b[1])


def grad_of_the_features(m, b):
    h = m.features(b[0])
    (g,) = torch.autograd.grad(h.sum(), m.features[0].weight, create_graph=True)
    return F.cross_entropy(m.head(h), b[1]) + g.pow(2).sum()


def backward_in_a_forward_hook(m, b):
    handle = m.head.register_forward_hook(lambda mod, i, o: o.pow(2).mean().backward(retain_graph=True))
    try:
        return ce_loss(m, b)
    finally:
        handle.remove()


INNER_BACKWARDS = {
    "aux.backward(retain_graph=True)": aux_backward,
    "gradient penalty, create_graph": gradient_penalty,
    "autograd.grad without a graph": saliency,
    "backward from between the BatchNorms": backward_below_the_second_batch_norm,
    "autograd.backward into chosen inputs": backward_into_chosen_inputs,
    "autograd.grad into a parameter below": grad_of_the_features,
    "backward in a forward hook": backward_in_a_forward_hook,
}
INNER_REFUSAL = (r"micro-batch 0 ran a backward .* through BatchNorm call \d \(BatchNorm1d features\.\d over 8 "
                 r"channels\) while the micro-batches' forwards were still running.*Nothing was changed.*forward_fn "
                 r"and batch_loss_fn")


@pytest.mark.parametrize("case", INNER_BACKWARDS)
def test_a_backward_inside_loss_fn_through_a_met_call_is_refused(schedule, case):
    exact_or_refused(net(), INNER_BACKWARDS[case], schedule, INNER_REFUSAL)


def inner_backward_above_the_batch_norms(m, b):
    out = m(b[0])
    m.head.weight.pow(2).sum().backward()  # a weight decay of the head's, added once per call of loss_fn
    return F.cross_entropy(out, b[1])


@pytest.mark.parametrize("case", [*INNER_BACKWARDS, "above the BatchNorms"])
def test_a_backward_inside_loss_fn_with_one_micro_batch(schedule, case):
    """With one micro-batch, loss_fn runs once, on the whole batch: layerwise is exact; passes, which runs the forward
    several times, refuses; another schedule may do either."""
    loss_fn = INNER_BACKWARDS.get(case, inner_backward_above_the_batch_norms)
    refusal = r"ran a backward|a backward inside your function"
    if schedule not in ("layerwise", "passes"):
        try:
            exact_or_refused(net(), loss_fn, schedule, None, micro=8)
            return
        except ValueError as e:
            assert re.search(refusal, str(e)), e
    exact_or_refused(net(), loss_fn, schedule, None if schedule == "layerwise" else refusal, micro=8)


def test_a_backward_inside_loss_fn_that_reaches_no_met_call_is_refused(schedule):
    """It changes .grad once per micro-batch (and pass), where the whole batch's loss_fn would once."""
    exact_or_refused(net(), inner_backward_above_the_batch_norms, schedule,
                     r"a backward inside your function .* changed the \.grad of the parameter head\.weight during the "
                     r"micro-batches' forwards.*Nothing was changed.*Add that term to the loss")


# ---------------------------------------------------------------- a gradient of the parameters in the user's functions
def head_gradient_penalty(m, b):
    out = m(b[0])
    loss = F.cross_entropy(out, b[1])
    (g,) = torch.autograd.grad(loss, m.head.weight, create_graph=True)
    return loss + g.pow(2).sum()


def head_gradient_as_a_weight(m, b):
    """GradNorm-like: the size of a gradient, without its graph, weighs the loss."""
    out = m(b[0])
    loss = F.cross_entropy(out, b[1])
    (g,) = torch.autograd.grad(loss, [m.head.weight], retain_graph=True)
    return loss * (1 + g.norm())


PARAMETER_GRADIENTS = {"gradient penalty of the head": head_gradient_penalty,
                       "the head's gradient as a weight": head_gradient_as_a_weight}


@pytest.mark.parametrize("case", PARAMETER_GRADIENTS)
def test_a_gradient_of_the_parameters_inside_loss_fn_is_refused(schedule_any, case):
    """torch.autograd.grad with respect to a parameter, in loss_fn: a gradient of one micro-batch's loss is not the
    whole batch's, so neither is a term made from it. Refused, as a .backward() there that reaches them is, with
    nothing changed; with one micro-batch (layerwise: its forward runs once, on the whole batch) exact."""
    loss_fn = PARAMETER_GRADIENTS[case]
    exact_or_refused(net(), loss_fn, schedule_any, r"torch\.autograd\.grad with respect to the model's parameter "
                                                   r"head\.weight in your function.*Nothing was changed.*batch_loss_fn")
    if schedule_any == "layerwise":
        exact_or_refused(net(), loss_fn, schedule_any, None, micro=8)


def head_penalty_of(model: nn.Module) -> Callable:
    def batch_loss_fn(out, targets):
        loss = F.cross_entropy(out, targets)
        (g,) = torch.autograd.grad(loss, model.head.weight, create_graph=True)
        return loss + g.pow(2).sum()
    return batch_loss_fn


def backward_of_its_own(out, targets):
    loss = F.cross_entropy(out, targets)
    loss.backward(retain_graph=True)
    return loss


@pytest.mark.parametrize("norm", ["batch", "group"])
@pytest.mark.parametrize("case", ["gradient penalty of the head", "a backward of its own"])
def test_batch_loss_fn_that_differentiates_is_exact_or_refused(schedule_any, case, norm):
    """batch_loss_fn sees the whole batch's outputs: layerwise runs it on their graph, where a gradient of the
    parameters, or a backward, is the whole batch's: exact. Passes, and one micro-batch at a time ("auto" without
    batch statistics), run it on the outputs without their graph, where that gradient would be lost or wrong:
    refused, with nothing changed."""
    model = net() if norm == "batch" else GroupNormNet().to(DT)
    (x, y), ref, ours = batch(), copy.deepcopy(model), copy.deepcopy(model)
    loss_of = (lambda m: head_penalty_of(m)) if case.startswith("gradient") else (lambda m: backward_of_its_own)
    expected = loss_of(ref)(ref(x), y)
    expected.backward()
    snap = snapshot(ours)
    try:
        loss = accumnorm.backward(ours, (x,), micro_batch_size=2, forward_fn=one_view_each,
                                  batch_loss_fn=loss_of(ours), targets=y, schedule=schedule_any)
    except ValueError as e:
        assert schedule_any != "layerwise", e
        assert re.search(r"Nothing was changed", str(e)) and re.search(
            r"torch\.autograd\.grad with respect to the model's parameter head\.weight|a backward inside "
            r"batch_loss_fn .* reached the outputs|a second backward through a (BatchNorm call|region of the segments "
            r"schedule)", str(e)), e
        assert_unchanged(ours, snap)
        return
    assert rel_err(loss, expected) <= 1e-9
    compare(ref, ours, 1e-9)


def test_a_graph_made_before_the_step_is_exact_or_refused_saying_why(schedule_any):
    """A regularizer computed once, before the step, added to every micro-batch's loss: one backward over the K
    losses takes it once in all (exact); passes back-propagates every micro-batch several times, where torch's
    "backward through the graph a second time" becomes a refusal that says what happened, with nothing changed."""
    model = net()

    def with_penalty(made):
        return lambda m, b: ce_loss(m, b) + 0.01 * made

    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    expected = whole_batch(ref, batch(), with_penalty(ref.head.weight.pow(2).sum()))
    snap = snapshot(ours)
    try:
        loss = accumnorm.backward(ours, batch(), with_penalty(ours.head.weight.pow(2).sum()), micro_batch_size=2,
                                  schedule=schedule_any)
    except ValueError as e:
        assert schedule_any == "passes", e
        assert re.search(r"graph was made before the step .* back-propagated a second time\. Nothing was changed",
                         str(e)), e
        assert_unchanged(ours, snap)
        return
    assert rel_err(loss, expected) <= 1e-9
    compare(ref, ours, 1e-9)
