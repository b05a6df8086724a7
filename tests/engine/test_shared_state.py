"""Python state the micro-batches share across a BatchNorm call, and batch norms the step does not see: under every
schedule each step is exact (against whole-batch torch) or refused with a clear ValueError and nothing changed."""
from __future__ import annotations

import copy
import re
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm
from helpers import assert_unchanged, ce_loss, compare, rel_err, snapshot, whole_batch
from models import Compiled, data

pytestmark = pytest.mark.usefixtures("one_thread")

REFUSED = (r"micro-batch \d+ used a tensor that micro-batch \d+ made|did not see|below F.batch_norm"
           r"|cannot make a BatchNorm call inside|training forwards of|holds another tensor as its parameter")


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Tanh(),
                         nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Tanh(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)).double()


def exact_or_refused(ref: nn.Module, ours: nn.Module, batch, schedule: str, expected_loss=None, **step) -> str:
    """`ours` steps as `ref` did over the whole batch (loss, gradients, buffers within 1e-9), or the step is refused
    with a ValueError that says so, and ours' gradients, buffers and the caller's random state are as they were."""
    ours.zero_grad()
    for p in ours.parameters():
        p.grad = torch.randn_like(p)  # gradients already accumulated: kept on a refusal, added to on success
    snap, rng = snapshot(ours), torch.random.get_rng_state()
    before = {n: p.grad.clone() for n, p in ours.named_parameters()}
    try:
        loss = accumnorm.backward(ours, batch, micro_batch_size=2, schedule=schedule, **step)
    except ValueError as e:
        assert re.search(REFUSED, str(e)), e
        assert "Nothing was changed" in str(e) or "cannot make" in str(e), e
        assert_unchanged(ours, snap)
        assert torch.equal(torch.random.get_rng_state(), rng)
        return "refused"
    for n, p in ours.named_parameters():
        p.grad -= before[n]
    if expected_loss is not None:
        assert rel_err(loss, expected_loss) < 1e-10
    compare(ref, ours, 1e-9)
    return "exact"


# ---------------------------------------------------------------- class 1: state shared across a BatchNorm call

class Cached(nn.Module):
    """A module that keeps its first conv's output in an attribute, which the loss reads."""

    def __init__(self) -> None:
        super().__init__()
        self.body = net()

    def forward(self, x):
        self.cache = self.body[0](x)
        h = self.body[1:](self.cache)
        return h


class KeepsNormalized(Cached):
    """A module that keeps its first BatchNorm's output in an attribute (a skip connection kept on the module)."""

    def forward(self, x):
        self.cache = self.body[:2](x)
        return self.body[2:](self.cache)


STASH: dict = {}


def _hook_attribute(model):
    model[0].register_forward_hook(lambda m, i, o: setattr(m, "stash", o))
    return lambda m: m[0].stash


def _hook_after_batch_norm(model):  # the stash of the last BatchNorm's block, read in the same turn: exact anywhere
    model[5].register_forward_hook(lambda m, i, o: setattr(m, "stash", o))
    return lambda m: m[5].stash


def _hook_global_dict(model):
    model[2].register_forward_hook(lambda m, i, o: STASH.__setitem__("feat", o))
    return lambda m: STASH["feat"]


def _hook_list(model):
    feats: list = []
    model[0].register_forward_hook(lambda m, i, o: feats.append(o))
    return lambda m: feats[-1]


def _hook_closure(model):
    box = [None]

    def hook(m, i, o):
        box[0] = o

    model[3].register_forward_hook(hook)
    return lambda m: box[0]


def _pre_hook(model):  # a forward pre-hook keeps the second BatchNorm's input
    model[4].register_forward_pre_hook(lambda m, args: STASH.__setitem__("seen", args[0]))
    return lambda m: STASH["seen"]


def _hook_batch_norm(model):  # a BatchNorm's own output: every micro-batch's rows are one node's outputs
    model[1].register_forward_hook(lambda m, i, o: setattr(m, "stash", o))
    return lambda m: m[1].stash


def _attribute(model):
    return lambda m: m.cache


def _deep_supervision(model):  # every block's output kept, each in a loss term
    for i in (2, 5):
        model[i].register_forward_hook(lambda m, i_, o: setattr(m, "stash", o))
    return lambda m: m[2].stash.mean((1, 2, 3))[:, None, None, None] + m[5].stash


STASHES = {"hook attribute": _hook_attribute, "hook after the last BatchNorm": _hook_after_batch_norm,
           "hook into a global dict": _hook_global_dict, "hook into a list": _hook_list,
           "hook into a closure": _hook_closure, "pre-hook into a global dict": _pre_hook,
           "module attribute": _attribute, "deep supervision": _deep_supervision,
           "hook on a BatchNorm": _hook_batch_norm, "BatchNorm output in a module attribute": _attribute}


def build_stash(case: str) -> tuple[nn.Module, callable]:
    model = {"module attribute": Cached, "BatchNorm output in a module attribute": KeepsNormalized}.get(case, net)()
    stash = STASHES[case](model)
    return model, stash


@pytest.mark.parametrize("case", sorted(STASHES))
@pytest.mark.parametrize("form", ["loss_fn", "whole-batch loss"])
def test_state_shared_across_a_batch_norm_call_is_exact_or_refused(schedule_any, case, form):
    """A forward hook's stash, a module attribute, a global, a list, a closure, read by the loss: each micro-batch
    must use its own (as the whole batch uses its own), or the step is refused."""
    model, stash = build_stash(case)
    ref, ours = model, copy.deepcopy(model)
    ref_stash = stash  # the copies' hooks write the copies' modules; the global ones are shared: read right after
    batch = data((1, 6, 6), 8, torch.float64)
    if form == "loss_fn":
        def loss_fn(m, b):
            return ce_loss(m, b) + stash(m).pow(2).mean()

        expected = whole_batch(ref, batch, lambda m, b: ce_loss(m, b) + ref_stash(m).pow(2).mean())
        outcome = exact_or_refused(ref, ours, batch, schedule_any, expected, loss_fn=loss_fn)
    else:
        def forward_fn(m, x):
            out = m(x)
            return {"logits": out, "feat": stash(m).flatten(1)}

        def batch_loss_fn(outputs, y):
            return F.cross_entropy(outputs["logits"], y) + outputs["feat"].pow(2).mean()

        expected = whole_batch(ref, batch, lambda m, b: batch_loss_fn(forward_fn(m, b[0]), b[1]))
        outcome = exact_or_refused(ref, ours, batch[0], schedule_any, expected, forward_fn=forward_fn,
                                   batch_loss_fn=batch_loss_fn, targets=batch[1])
    # Each micro-batch's forward alone, or no BatchNorm call between write and read; but under segments a region's
    # exit is a meeting point too, and the stash is written inside the region and read after it.
    if schedule_any == "passes" or (case == "hook after the last BatchNorm" and schedule_any != "segments"):
        assert outcome == "exact"


class KeepsInput(nn.Module):
    """A model that keeps its input in an attribute and adds it back after its first BatchNorm call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = net()

    def forward(self, x):
        self.input = x
        h = self.body[:3](x)
        return self.body[3:](h + self.input.mean(1, keepdim=True))


def test_an_input_with_a_graph_kept_across_a_batch_norm_call_is_exact_or_refused(schedule_any):
    """A batch that requires grad (adversarial training) is cut into micro-batches before any of them runs: each
    micro-batch's samples are one output of the cut's node, and a micro-batch must use its own."""
    model = KeepsInput()
    ref, ours = model, copy.deepcopy(model)
    x, y = data((1, 6, 6), 8, torch.float64)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = whole_batch(ref, (x_ref, y))
    outcome = exact_or_refused(ref, ours, (x_ours, y), schedule_any, expected, loss_fn=ce_loss)
    if outcome == "exact":
        assert rel_err(x_ours.grad, x_ref.grad) < 1e-9
    else:
        assert x_ours.grad is None
    if schedule_any == "passes":
        assert outcome == "exact"


def _outside(model, prefixes=("3.", "4.", "8.")) -> dict:
    """Copies of the parameters named with `prefixes`, held outside the model; the first conv's stay the model's."""
    return {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters() if n.startswith(prefixes)}


def _outside_leaves(model):  # the usual functional_call: parameters held outside the model
    held = _outside(model)
    return held, lambda m: held


def _made_in_the_loss(model):  # each micro-batch makes its own (a reparametrization written by hand)
    return {}, lambda m: {n: p * 1.0 for n, p in m.named_parameters()}


def _head_only(model):  # only the layers after the last BatchNorm, swapped in across the earlier calls
    held = _outside(model, ("8.",))
    return held, lambda m: held


def _with_a_buffer(model):  # parameters and a BatchNorm's running statistics, as torch.func users pass them
    held = _outside(model)
    return held, lambda m: {**held, **dict(m.named_buffers())}


SWAPS = {"parameters held outside": _outside_leaves, "parameters made in loss_fn": _made_in_the_loss,
         "the head's parameters only": _head_only, "parameters and the model's own buffers": _with_a_buffer}


@pytest.mark.parametrize("case", sorted(SWAPS))
def test_parameters_swapped_in_by_functional_call_are_exact_or_refused_and_put_back(schedule_any, case):
    """torch.func.functional_call swaps tensors into the model's modules for the call and back after it: the
    interleaved micro-batches' swaps and restores cross at every BatchNorm call, so some ran with the model's own
    parameters and the model ended with the swapped ones. Exact, or refused with the model's parameters, their
    gradients and the outside leaves' as they were."""
    model = net()
    ref, ours = model, copy.deepcopy(model)
    ref_held, ref_swap = SWAPS[case](ref)
    held, swap = SWAPS[case](ours)
    own = list(ours.parameters())
    batch = data((1, 6, 6), 8, torch.float64)

    def loss(swapped):
        return lambda m, b: F.cross_entropy(torch.func.functional_call(m, swapped(m), (b[0],)), b[1])

    for p in ref.parameters():  # the swapped parameters get no gradient: zeros on both sides
        p.grad = torch.zeros_like(p)
    expected = whole_batch(ref, batch, loss(ref_swap))
    outcome = exact_or_refused(ref, ours, batch, schedule_any, expected, loss_fn=loss(swap))
    assert [p for p in ours.parameters()] == own and all(a is b for a, b in zip(ours.parameters(), own))
    for name, t in held.items():
        if outcome == "exact":
            assert rel_err(t.grad, ref_held[name].grad) < 1e-9, name
        else:
            assert t.grad is None, name
    if schedule_any == "passes":
        assert outcome == "exact"


def test_a_loss_fn_that_leaves_the_model_in_eval_is_exact_or_refused_with_the_modes_put_back(schedule_any):
    """loss_fn ends with model.eval() (a validation pass follows): whole-batch torch ran the forward in train mode
    and leaves the model in eval. A refused step puts the train/eval modes back with everything else; a schedule
    that starts the step over (recompute, finding the change before its backward, then layerwise) puts them back
    first, or its second run would normalize with the running statistics."""
    model = net()
    ref, ours = model, copy.deepcopy(model)
    batch = data((1, 6, 6), 8, torch.float64)

    def loss_fn(m, b):
        loss = ce_loss(m, b)
        m.eval()
        return loss

    expected = whole_batch(ref, batch, loss_fn)
    snap = snapshot(ours)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # recompute's fallback to layerwise says why
            loss = accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2, schedule=schedule_any)
    except ValueError as e:
        assert "Nothing was changed" in str(e) or "nothing was changed" in str(e), e
        assert_unchanged(ours, snap)
        assert all(m.training for m in ours.modules())
        return
    assert rel_err(loss, expected) < 1e-10
    compare(ref, ours, 1e-9)
    assert not any(m.training for m in ours.modules())  # as the whole batch left it


class ReadsRunningStatistics(nn.Module):
    """A net whose forward reads its first BatchNorm's running statistics after that layer's training call."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.body, self.read = net(), read

    def forward(self, x):
        h = self.body[0](x)
        bn = self.body[1]
        if self.read == "eval-mode call before":  # the same layer in eval before its training call, which moves them
            h = h + F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False).tanh()
        a = self.body[1:3](h)
        if self.read == "eval-mode call":  # the same layer, normalizing with its running statistics
            a = a + F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False).tanh()
        elif self.read == "scale by running_var":
            a = a * bn.running_var.view(1, -1, 1, 1)
        return self.body[3:](a)


def _teacher_pass(m, b):  # mean-teacher style: targets from the same model in eval, after its training forward
    out = m(b[0])
    m.eval()
    with torch.no_grad():
        target = m(b[0] + 0.1)
    m.train()
    return F.cross_entropy(out, b[1]) + F.mse_loss(out, target)


def _scaled_by_running_mean(m, b):  # a loss term scaled by a running statistic, read after the forward
    return F.cross_entropy(m(b[0]) * (1 + m.body[1].running_mean.abs().sum()), b[1])


RUNNING_READS = {"eval-mode call": ("eval-mode call", ce_loss),
                 "eval-mode call before the training call": ("eval-mode call before", ce_loss),
                 "scale by running_var": ("scale by running_var", ce_loss),
                 "teacher pass in eval": ("", _teacher_pass),
                 "loss scaled by running_mean": ("", _scaled_by_running_mean)}


@pytest.mark.parametrize("case", sorted(RUNNING_READS))
def test_running_statistics_read_after_their_call_are_the_whole_batchs_at_that_point(schedule_any, case):
    """A forward or loss_fn that reads a BatchNorm's running statistics after its training call finds them as the
    whole batch's forward left them there (moved once by that call), under every schedule: passes, which moves
    them once at the step's end, gives each of its forwards the values after each call as it makes it. An eval-mode
    call before the training call saves them for its backward: torch's kernel moves them without counting a version,
    and so does passes (its counted write failed the backward with torch's in-place error)."""
    read, loss_fn = RUNNING_READS[case]
    model = ReadsRunningStatistics(read)
    ref, ours = model, copy.deepcopy(model)
    batch = data((1, 6, 6), 8, torch.float64)
    expected = whole_batch(ref, batch, loss_fn)
    assert exact_or_refused(ref, ours, batch, schedule_any, expected, loss_fn=loss_fn) == "exact"


@pytest.mark.parametrize("alias", ["the tensor", "detach", "data"])
def test_two_batch_norms_sharing_running_statistics_are_refused_saying_so(schedule_any, alias):
    """One running statistic held by two layers: the same tensor, or two tensors over one memory (`.detach()` of the
    other's, or `.data` set to it), which the identity check let through, and passes then gave other running
    statistics than the whole batch's, silently."""
    model = net()
    for name in ("running_mean", "running_var"):
        if alias == "data":
            getattr(model[4], name).data = getattr(model[1], name).data
        else:
            shared = getattr(model[1], name)
            setattr(model[4], name, shared.detach() if alias == "detach" else shared)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"the BatchNorm layers 1 and 4 hold the same running_mean tensor.*Nothing "
                                         r"was changed"):
        accumnorm.backward(model, data((1, 6, 6), 8, torch.float64), ce_loss, micro_batch_size=2,
                           schedule=schedule_any)
    assert_unchanged(model, snap)


def test_batch_norms_with_lazy_or_empty_running_statistics_are_told_apart():
    """Lazy layers' running statistics have no memory before their first call: each is its own, not one shared."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.LazyBatchNorm2d(), nn.Conv2d(4, 4, 1), nn.LazyBatchNorm2d(),
                          nn.Flatten(), nn.LazyLinear(10)).double()
    accumnorm.backward(model, data((1, 6, 6), 8, torch.float64), ce_loss, micro_batch_size=2)
    assert int(model[1].num_batches_tracked) == int(model[3].num_batches_tracked) == 1


def test_a_teacher_in_train_mode_outside_the_model_is_refused_at_its_first_call(schedule_any):
    """A teacher's BatchNorm in train mode, run under no_grad in loss_fn: its running statistics are not the model's,
    which the step could neither update once nor restore. Refused at the teacher's first call, before any other
    micro-batch's counts it up: the teacher's statistics untouched, its counter one up (its forward's own, before the
    call), the model as it was."""
    model, teacher = net(), net()
    snap, before = snapshot(model), [b.clone() for b in teacher.buffers()]

    def loss_fn(m, b):
        with torch.no_grad():
            target = teacher(b[0]).softmax(1)
        return F.cross_entropy(m(b[0]), target)

    with pytest.raises(ValueError, match=r"running statistics are not buffers of the model .*teacher in train mode"
                                         r".*Nothing was changed"):
        accumnorm.backward(model, data((1, 6, 6), 8, torch.float64), loss_fn, micro_batch_size=2,
                           schedule=schedule_any)
    assert_unchanged(model, snap)
    for (name, b), b0 in zip(teacher.named_buffers(), before):
        assert torch.equal(b, b0 + 1 if name == "1.num_batches_tracked" else b0), name


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch.compile(body)", "body.compile()"])
def test_a_compiled_batch_norm_is_exact_at_every_step_and_leaves_no_frame_callback(schedule_any, how):
    """A BatchNorm inside a torch.compile'd module: dynamo would compile it into its graph, where it normalizes one
    micro-batch alone, and trace the step's own code at each call it graph-breaks on (at the third step under
    aot_eager, dynamo once failed on its own assertion). The graph breaks at each call instead: exact at every step,
    no frame callback left on the thread."""
    torch._dynamo.reset()
    model = Compiled(net(), backend="aot_eager") if how.startswith("torch") else net()
    if how == "body.compile()":
        model.compile(backend="aot_eager")
    batch = data((1, 6, 6), 8, torch.float64)
    for _ in range(3):
        ref = copy.deepcopy(model)
        expected = whole_batch(ref, batch)
        assert exact_or_refused(ref, model, batch, schedule_any, expected, loss_fn=ce_loss) == "exact"
        assert torch._C._dynamo.eval_frame.get_eval_frame_callback() is None
    torch._dynamo.reset()


class ReadsLocal(nn.Module):
    """A model that reads, after its first BatchNorm call, a tensor that loss_fn keeps in a threading.local."""

    def __init__(self, local: threading.local) -> None:
        super().__init__()
        self.body, self.local = net(), local

    def forward(self, x):
        h = self.body[:3](x)
        return self.body[3:](h + self.local.shift)


@pytest.mark.realtime
def test_a_threading_local_with_a_graph_read_after_a_batch_norm_call_is_exact_or_refused(schedule_any):
    local = threading.local()
    ref, ours = ReadsLocal(local), ReadsLocal(local)  # the same weights (net() seeds), one threading.local
    batch = data((1, 6, 6), 8, torch.float64)

    def loss_fn(m, b):
        local.shift = m.body[0](b[0]).mean((1,), keepdim=True)  # the micro-batch's own, with a graph
        return ce_loss(m, b)

    expected = whole_batch(ref, batch, loss_fn)
    exact_or_refused(ref, ours, batch, schedule_any, expected, loss_fn=loss_fn)


# ---------------------------------------------------------------- class 2: batch norms the step does not see

class Raw(nn.Module):
    """A BatchNorm2d's tensors normalized by a batch-norm call below F.batch_norm (`how`)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.body = how, net()
        if how == "scripted":
            self.fn = torch.jit.script(_scripted_batch_norm)

    def forward(self, x):
        conv, bn = self.body[0], self.body[1]
        h = conv(x)
        args = (h, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5)
        if self.how == "native_batch_norm":
            h = torch.native_batch_norm(*args)[0]
        elif self.how == "aten.native_batch_norm":
            h = torch.ops.aten.native_batch_norm.default(*args)[0]
        elif self.how == "_native_batch_norm_legit":
            h = torch._native_batch_norm_legit(*args)[0]
        elif self.how == "_native_batch_norm_legit without statistics":
            h = torch._native_batch_norm_legit(h, bn.weight, bn.bias, True, 0.1, 1e-5)[0]
        elif self.how == "aten.batch_norm":
            h = torch.ops.aten.batch_norm.default(h, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1,
                                                  1e-5, False)
        elif self.how == "scripted":
            h = self.fn(h, bn.weight, bn.bias)
        elif self.how == "direct F.batch_norm":  # on the layer's own tensors, the layer never called: torch runs it
            h = F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, True)
        elif self.how == "direct F.batch_norm and the layer":
            h = bn(F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 0.3))
        return self.body[2:](h)


def _scripted_batch_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, None, None, w, b, True)


class InThread(nn.Module):
    """Its BatchNorm (without running statistics) runs in a worker thread."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(36, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 10)

    def forward(self, x):
        out = []
        worker = threading.Thread(target=lambda: out.append(self.bn(self.lin(x.flatten(1)))))
        worker.start()
        worker.join()
        return self.head(torch.tanh(out[0]))


class BatchNormInside(torch.autograd.Function):
    """A custom Function whose forward enables grad and runs a BatchNorm, its backward through that graph."""

    @staticmethod
    def forward(ctx, x, bn):
        with torch.enable_grad():
            inner = x.detach().requires_grad_()
            y = bn(inner)
        ctx.save_for_backward(inner, y)
        return y.detach()

    @staticmethod
    def backward(ctx, grad):
        inner, y = ctx.saved_tensors
        return torch.autograd.grad(y, inner, grad)[0], None


class WithFunction(nn.Module):
    def __init__(self, track: bool) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=track)
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        return self.head(torch.tanh(BatchNormInside.apply(self.conv(x), self.bn)).mean((2, 3)))


UNSEEN = {
    **{how: lambda how=how: Raw(how) for how in (
        "native_batch_norm", "aten.native_batch_norm", "_native_batch_norm_legit",
        "_native_batch_norm_legit without statistics", "aten.batch_norm", "scripted", "direct F.batch_norm",
        "direct F.batch_norm and the layer")},
    "a worker thread": InThread,
    "a custom Function that enables grad": lambda: WithFunction(True),
    "a custom Function that enables grad, no running statistics": lambda: WithFunction(False),
}


def twins(make) -> list[nn.Module]:
    """Two models made alike (not a deep copy: a TorchScript function cannot be copied)."""
    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        twins.append(make().double())
    return twins


@pytest.mark.parametrize("case", sorted(UNSEEN))
def test_a_batch_norm_below_the_steps_reach_is_exact_or_refused(schedule_any, case):
    ref, ours = twins(UNSEEN[case])
    batch = data((1, 6, 6), 8, torch.float64)
    expected = whole_batch(ref, batch)
    outcome = exact_or_refused(ref, ours, batch, schedule_any, expected, loss_fn=ce_loss)
    if case.startswith("direct"):
        assert outcome == "exact"  # F.batch_norm is the step's to see: it is made exact


def test_a_direct_call_on_a_batch_norms_tensors_updates_as_torch_does(schedule_any):
    """Two steps (running statistics carried on): the layer's counter stays where torch leaves it."""
    ref, ours = twins(lambda: Raw("direct F.batch_norm"))
    for seed in range(2):
        torch.manual_seed(seed)
        batch = data((1, 6, 6), 8, torch.float64)
        ref.zero_grad()
        ours.zero_grad()
        expected = whole_batch(ref, batch)
        assert rel_err(accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule=schedule_any),
                       expected) < 1e-10
        compare(ref, ours, 1e-9)
    assert int(ours.body[1].num_batches_tracked) == 0


def test_autocasts_cached_weight_casts_are_shared_not_refused(schedule_any):
    """Under autocast, a parameter's low-precision cast is made once, in the first micro-batch's turn, and cached
    for the others: the same values for all, as in one whole-batch forward. The step runs (no refusal of a
    "shared tensor") and lands nearer whole-batch torch under the same autocast than plain accumulation does."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                        nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    ours, micro = copy.deepcopy(ref), copy.deepcopy(ref)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))

    def loss_fn(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(m(b[0]).float(), b[1])

    loss_fn(ref, (x, y)).backward()
    accumnorm.backward(ours, (x, y), loss_fn, micro_batch_size=4, schedule=schedule_any)
    accumnorm.backward(micro, (x, y), loss_fn, micro_batch_size=4, bn="micro")
    def flat(m):
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    truth = flat(ref)
    ours_err, micro_err = ((flat(m) - truth).abs().max() / truth.abs().max() for m in (ours, micro))
    assert ours_err < micro_err / 4, (ours_err, micro_err)
