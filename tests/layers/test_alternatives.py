"""The alternatives to BatchNorm: oracle formulas, timm's outputs, train/eval, state_dict, lazy channels, factory."""
import copy

import pytest
import torch
import torch.nn.functional as F

import accumnorm
from accumnorm import BatchRenorm2d, EvoNorm2dS0, FilterResponseNorm2d, StaleBatchNorm2d

NAMES = {"brn": BatchRenorm2d, "bn-stale": StaleBatchNorm2d, "frn": FilterResponseNorm2d, "evonorm-s0": EvoNorm2dS0}


def _x(n=4, c=32, size=5, seed=0):
    return torch.randn(n, c, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 2 + 1


def _randomize(m, seed=1):
    """Parameters off their initial values, so that formulas are tested with non-trivial ones."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.rand(p.shape, dtype=p.dtype, generator=gen) + 0.5)
    return m


@pytest.mark.parametrize("name", NAMES)
def test_factory_names_build_lazy_layers_that_behave_like_torch_norms(name):
    lazy = accumnorm.norm(name)
    assert isinstance(lazy, NAMES[name]) and lazy.num_features is None and lazy.has_uninitialized_params()
    x = _x().float()
    lazy(x)
    assert lazy.num_features == 32 and not lazy.has_uninitialized_params()
    fixed = accumnorm.norm(name, 32)
    fixed.load_state_dict(lazy.state_dict())
    assert fixed.state_dict().keys() == lazy.state_dict().keys()
    assert all(t.shape == (32,) for t in fixed.state_dict().values() if t.dim())
    lazy.eval(), fixed.eval()
    torch.testing.assert_close(fixed(x), lazy(x))
    # A lazy layer also loads a materialized state_dict before its first forward.
    late = accumnorm.norm(name)
    late.load_state_dict(fixed.state_dict())
    late.eval()
    torch.testing.assert_close(late(x), fixed(x))


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_a_clear_error(name):
    m = accumnorm.norm(name, 32)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        m(torch.randn(2, 32, 5))
    with pytest.raises(ValueError, match=r"expected 32 channels at dim 1, got input of shape \(2, 16, 5, 5\)"):
        m(torch.randn(2, 16, 5, 5))
    with pytest.raises(TypeError, match="num_features must be a positive int or None"):
        accumnorm.norm(name, 32.0)


def test_unknown_names_list_the_alternatives():
    with pytest.raises(ValueError, match=r"valid names: .*brn, bn-stale, frn, evonorm-s0"):
        accumnorm.norm("renorm")


@pytest.mark.parametrize("name, layer", [("bn", "BatchNorm2d"), ("gn4", "GroupNorm"), ("brn", "BatchRenorm2d")])
def test_a_keyword_the_layer_does_not_take_names_the_layer_and_what_it_takes(name, layer):
    """The error came from the base class that refused it (LazyNormBase.__init__), naming neither."""
    with pytest.raises(TypeError, match=rf"norm\('{name}'\) builds {layer}, which takes num_\w+, .*eps.*: got an "
                                        r"unexpected keyword argument 'epsilon'"):
        accumnorm.norm(name, 8, epsilon=1e-3)


@pytest.mark.parametrize("ours_cls, timm_name", [(FilterResponseNorm2d, "FilterResponseNormTlu2d"),
                                                  (EvoNorm2dS0, "EvoNorm2dS0")])
def test_frn_and_evonorm_s0_agree_with_timm(ours_cls, timm_name):
    layers = pytest.importorskip("timm.layers")
    theirs = _randomize(getattr(layers, timm_name)(64))
    ours = _randomize(ours_cls(64))
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = _x(c=64).float().requires_grad_()
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    g_ours = torch.autograd.grad(ours(x).square().sum(), [x, *ours.parameters()])
    g_theirs = torch.autograd.grad(theirs(x).square().sum(), [x, *theirs.parameters()])
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    ours.eval(), theirs.eval()  # no batch statistics: eval is the same computation
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_frn_and_evonorm_are_per_sample():
    x = _x()
    for m in (_randomize(FilterResponseNorm2d(32)), _randomize(EvoNorm2dS0(32, num_groups=8))):
        torch.testing.assert_close(m(x)[1:2], m(x[1:2]))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_renorm_during_warmup_is_torch_batchnorm(momentum):
    """r_max = 1, d_max = 0: outputs, gradients and running statistics of torch's BatchNorm2d, also with
    momentum=None (torch's cumulative average: it failed in lerp_)."""
    ours, ref = _randomize(BatchRenorm2d(32, momentum=momentum, warmup=10, r_max_at=20, d_max_at=20).double()), \
        _randomize(torch.nn.BatchNorm2d(32, momentum=momentum).double())
    for step in range(3):
        x = _x(seed=step).requires_grad_()
        y, y_ref = ours(x), ref(x)
        torch.testing.assert_close(y, y_ref)
        grads = [torch.autograd.grad(out.square().sum(), [x, m.weight, m.bias]) for out, m in ((y, ours), (y_ref, ref))]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(ours.state_dict()[key], ref.state_dict()[key])
    ours.eval(), ref.eval()
    torch.testing.assert_close(ours(_x(seed=9)), ref(_x(seed=9)))


def test_batch_renorm_takes_bfloat16_input_with_float32_statistics_as_torchs_batchnorm():
    """Autocast gives a bfloat16 activation to a layer whose parameters and statistics are float32: torch's
    BatchNorm2d takes it, BatchRenorm2d failed moving its running statistics (lerp_ of another dtype)."""
    ours, ref = BatchRenorm2d(8, warmup=10, r_max_at=20, d_max_at=20), torch.nn.BatchNorm2d(8)
    x = _x(c=8).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = ours(x.bfloat16()), ref(x.bfloat16())
    assert y.dtype == y_ref.dtype and ours.running_mean.dtype == torch.float32
    torch.testing.assert_close(y.float(), y_ref.float(), atol=0.05, rtol=0.05)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, atol=0.02, rtol=0.02)


def test_batch_renorm_corrects_towards_the_running_statistics_with_r_and_d_held_constant():
    m = _randomize(BatchRenorm2d(32, r_max=1.5, d_max=0.5, warmup=0, r_max_at=1, d_max_at=1).double())
    with torch.no_grad():
        m.running_mean.uniform_(-1, 1)
        m.running_var.uniform_(0.5, 3)
        m.num_batches_tracked.fill_(5)
    mean0, var0 = m.running_mean.clone(), m.running_var.clone()
    x = _x().requires_grad_()
    # The paper's formula, with r and d detached.
    dims = (0, 2, 3)
    mean_b, var_b = x.mean(dims), x.var(dims, unbiased=False)
    std_b, std = (var_b + m.eps).sqrt(), (var0 + m.eps).sqrt()
    r = (std_b / std).clamp(1 / 1.5, 1.5).detach()
    d = ((mean_b - mean0) / std).clamp(-0.5, 0.5).detach()
    assert (r == 1.5).any() and (r < 1.5).any() and (d.abs() == 0.5).any()  # both clipped and unclipped channels
    shape = (1, -1, 1, 1)
    want = m.weight.view(shape) * ((x - mean_b.view(shape)) / std_b.view(shape) * r.view(shape) + d.view(shape)) \
        + m.bias.view(shape)
    got = m(x)
    torch.testing.assert_close(got, want)
    upstream = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, [x, m.weight, m.bias], upstream),
                    torch.autograd.grad(want, [x, m.weight, m.bias], upstream)):
        torch.testing.assert_close(a, b)
    n = x.numel() // 32
    torch.testing.assert_close(m.running_mean, 0.9 * mean0 + 0.1 * mean_b.detach())
    torch.testing.assert_close(m.running_var, 0.9 * var0 + 0.1 * var_b.detach() * n / (n - 1))


def test_batch_renorm_warmup_schedule():
    m = BatchRenorm2d(4, r_max=3.0, d_max=5.0, warmup=100, r_max_at=300, d_max_at=200)
    for t, want in [(0, (1.0, 0.0)), (100, (1.0, 0.0)), (150, (1.5, 2.5)), (200, (2.0, 5.0)), (300, (3.0, 5.0)),
                    (10_000, (3.0, 5.0))]:
        m.num_batches_tracked.fill_(t)
        assert m.bounds() == pytest.approx(want)
    with pytest.raises(ValueError, match="expected r_max >= 1"):
        BatchRenorm2d(4, r_max=0.5)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_stale_batchnorm_normalizes_with_the_previous_steps_whole_batch_statistics(momentum):
    """Micro-batches of a step use the last step's statistics; its step end makes them the whole batch's. With
    momentum=None too: torch's cumulative average over the steps (it failed in lerp_)."""
    m = _randomize(StaleBatchNorm2d(32, momentum=momentum).double())
    ref = _randomize(torch.nn.BatchNorm2d(32, momentum=momentum).double())  # torch's on the whole batch: the oracle
    steps = [_x(n=6, seed=s) for s in range(3)]
    stale_mean, stale_var = torch.zeros(32, dtype=torch.float64), torch.ones(32, dtype=torch.float64)
    for x in steps:
        for part in x.split(2):  # 3 micro-batches of 2
            part = part.clone().requires_grad_()
            out = m(part)
            want = F.batch_norm(part, stale_mean, stale_var, m.weight, m.bias, False, 0.0, m.eps)
            torch.testing.assert_close(out, want)
            g = torch.autograd.grad(out.square().sum(), part)[0]  # statistics are constants of the backward
            torch.testing.assert_close(g, torch.autograd.grad(want.square().sum(), part)[0])
        m.accumnorm_step_end()
        m.accumnorm_step_end()  # idempotent: the core and a caller may both call it
        ref(x)
        stale_mean, stale_var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
        torch.testing.assert_close(m.stale_mean, stale_mean)
        torch.testing.assert_close(m.stale_var, stale_var)
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(m.state_dict()[key], ref.state_dict()[key])
    m.eval(), ref.eval()
    torch.testing.assert_close(m(_x(seed=7)), ref(_x(seed=7)))  # eval: running statistics, as torch's


def test_stale_batchnorm_through_accumnorm_backward():
    """accumnorm.backward ends the step: its moments are the next step's statistics; a failed step changes nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), StaleBatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.LazyLinear(4)).double()
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.randint(0, 4, (8,))
    model(x[:1])  # materialize the lazy head (this forward's moments are dropped below)
    bn = model[1]
    bn.step_count.zero_(), bn.step_mean.zero_(), bn.step_m2.zero_()
    accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=2, bn="exact")
    with torch.no_grad():
        h = model[0](x)
    torch.testing.assert_close(bn.stale_mean, h.mean((0, 2, 3)))
    torch.testing.assert_close(bn.stale_var, h.var((0, 2, 3), unbiased=False))
    before = {k: t.clone() for k, t in bn._buffers.items()}
    with pytest.raises(ValueError, match="not finite"):
        accumnorm.backward(model, (x, y), lambda m, b: m(b[0]).sum() * float("nan"), micro_batch_size=2, bn="exact")
    for k, t in bn._buffers.items():
        assert torch.equal(t, before[k]), k


@pytest.mark.parametrize("name", NAMES)
def test_deepcopy_and_train_eval_flags(name):
    m = accumnorm.norm(name, 32)
    m(_x().float())
    c = copy.deepcopy(m).eval()
    assert not c.training and m.training
    for key, t in m.state_dict().items():
        torch.testing.assert_close(c.state_dict()[key], t)


@pytest.mark.parametrize("name", NAMES)
def test_a_lazy_layer_deep_copies_before_its_first_forward(name):
    """A model built with lazy norms is copied before its first batch (an EMA copy, a fork per run)."""
    lazy = accumnorm.norm(name)
    twin = copy.deepcopy(lazy)
    assert twin.has_uninitialized_params() and twin is not lazy
    x = _x().float()
    assert twin(x).shape == x.shape and twin.num_features == 32 and lazy.has_uninitialized_params()


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_batch_in_training_changes_no_statistic_as_torchs_batchnorm(name):
    """An empty batch gives an empty output whose backward gives zero gradients, and leaves the statistics as they were
    (torch's BatchNorm counts the forward in num_batches_tracked: a layer counts it as it counts any forward)."""
    m = accumnorm.norm(name, 32).double()
    m(_x())  # statistics off their initial values
    counts = copy.deepcopy(m)
    counts(_x(seed=2))  # what a forward adds to the counter
    before = {k: t.clone() for k, t in m.state_dict().items()}
    x = torch.empty(0, 32, 4, 4, dtype=torch.float64, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == x.shape
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in m.parameters())
    for key, t in m.state_dict().items():
        want = counts.state_dict()[key] if key == "num_batches_tracked" else before[key]
        assert torch.equal(t, want), key


@pytest.mark.parametrize("name", NAMES)
def test_a_channels_last_input_gives_the_contiguous_inputs_output(name):
    m = _randomize(accumnorm.norm(name, 32).double())
    x = _x()
    torch.testing.assert_close(m(x.to(memory_format=torch.channels_last)), copy.deepcopy(m)(x), rtol=1e-12, atol=0)


@pytest.mark.parametrize("layer", [BatchRenorm2d, StaleBatchNorm2d])
def test_reset_parameters_starts_the_counters_again_as_torchs_batchnorm(layer):
    """torch's BatchNorm.reset_parameters zeroes num_batches_tracked; these kept theirs (and StaleBatchNorm2d its
    step's count), so that a momentum=None average after a reset was 3.8 off the batch mean, a renorm's warm-up did not
    start again, and a layer built on the meta device and reset after to_empty (as FSDP does) kept whatever the
    empty memory held."""
    torch.manual_seed(0)
    x0, x = torch.randn(8, 4, 3, 3, dtype=torch.float64), torch.randn(8, 4, 3, 3, dtype=torch.float64) + 5
    ours, torchs = layer(4, momentum=None, dtype=torch.float64), torch.nn.BatchNorm2d(4, momentum=None,
                                                                                      dtype=torch.float64)
    for _ in range(3):
        ours(x0)
        torchs(x0)
        getattr(ours, "accumnorm_step_end", lambda: None)()
    ours.reset_parameters()
    torchs.reset_parameters()
    ours(x)
    torchs(x)
    getattr(ours, "accumnorm_step_end", lambda: None)()
    assert int(ours.num_batches_tracked) == int(torchs.num_batches_tracked) == 1
    torch.testing.assert_close(ours.running_mean, torchs.running_mean)
    built = layer(4, device="meta").to_empty(device="cpu")
    for counter in ("num_batches_tracked", "step_count"):
        if counter in built._buffers:
            built._buffers[counter].fill_(123456)
    built.reset_parameters()
    fresh = layer(4)
    for name, t in fresh.named_buffers():
        assert torch.equal(dict(built.named_buffers())[name], t), name
