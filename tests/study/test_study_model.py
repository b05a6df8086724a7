"""Oracle tests: R runs stacked into one wide model behave exactly as R separate SimpleModels."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accumnorm
from accumnorm.study import StudySettings
from accumnorm.study._model import SimpleModel, SingleRun, StackedModel, norm_fn, stackable

R = 3
STACKABLE = ["bn", "bn-exact", "gn4", "gn16", "in", "none", "gn8", "bn2d",  # study names and accumnorm names
             "brn", "bn-stale", "frn"]  # alternatives (EvoNorm-S0's 32 groups need wider layers: tested below)


def _runs(name, seed=0):
    """R models as the runner builds them (run r under seed r), with non-trivial norm affine params."""
    models = []
    for r in range(R):
        torch.manual_seed(seed + r)
        m = SimpleModel(norm_fn(name), channels=(16, 16, 32, 32))
        for mod in m.modules():
            if getattr(mod, "weight", None) is not None and mod.weight.dim() == 1:  # norm affine: off its init
                with torch.no_grad():
                    mod.weight.uniform_(0.5, 1.5)
                    mod.bias.uniform_(-0.5, 0.5)
        models.append(m)
    return models


def _block(t, r):
    return t.chunk(R, dim=0)[r]  # run r owns block r along dim 0 of every stacked tensor


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(0).sum()


def _data(n=8, size=16):
    torch.manual_seed(123)
    return torch.rand(n, R, 1, size, size), torch.randint(0, 10, (n, R))


@pytest.mark.parametrize("name", STACKABLE)
def test_stacked_outputs_and_gradients_equal_separate_runs(name):
    models = _runs(name)
    stacked = StackedModel(_runs(name))  # same seeds: identical initial weights, packed
    x, y = _data()
    out = stacked(x)
    _loss(stacked, (x, y)).backward()
    for r, m in enumerate(models):
        torch.testing.assert_close(out[:, r], m(x[:, r]), rtol=1e-4, atol=1e-5)
        F.cross_entropy(m(x[:, r]), y[:, r]).backward()
        for (pn, p), q in zip(m.named_parameters(), stacked.parameters()):
            torch.testing.assert_close(_block(q.grad, r).reshape(p.shape), p.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, pn=pn: f"{pn}: {m}")


@pytest.mark.parametrize("name,bn", [("bn", "micro"), ("bn-exact", "exact"), ("gn4", "micro")])
def test_training_steps_with_adam_equal_separate_runs(name, bn):
    """Three Adam steps through accumnorm.backward (K=4 micro-batches of 2): weights, running stats, eval outputs.

    In float64: a conv bias right before BatchNorm has a zero gradient in exact arithmetic, and
    Adam turns its float32 round-off (~1e-8, the size of Adam's eps) into full-size steps.
    """
    models, stacked = [m.double() for m in _runs(name)], StackedModel(_runs(name)).double()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    opt = torch.optim.Adam(stacked.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _data(8, size=8)
        x = x.double() + step  # a different batch each step
        accumnorm.backward(stacked, (x, y), _loss, micro_batch_size=2, bn=bn)
        opt.step()
        opt.zero_grad()
        for r, (m, o) in enumerate(zip(models, opts)):
            accumnorm.backward(m, (x[:, r], y[:, r]), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                               micro_batch_size=2, bn=bn)
            o.step()
            o.zero_grad()
    stacked.eval()
    x = _data(5, size=8)[0].double()
    for r, m in enumerate(models):
        for (pn, p), q in zip(m.state_dict().items(), stacked.state_dict().values()):
            if p.dim():
                torch.testing.assert_close(_block(q, r).reshape(p.shape), p, rtol=1e-6, atol=1e-6,
                                           msg=lambda m, pn=pn: f"{pn}: {m}")
        torch.testing.assert_close(stacked(x)[:, r], m.eval()(x[:, r]), rtol=1e-6, atol=1e-6)


def test_exact_bn_at_micro_batch_1_matches_torch_bn_on_the_whole_batch():
    """bn-exact at 1x8 gives the gradient torch's BatchNorm gives at 8x1, also when stacked."""
    stacked_exact, stacked_big = StackedModel(_runs("bn-exact")), StackedModel(_runs("bn"))
    x, y = _data(8)
    accumnorm.backward(stacked_exact, (x, y), _loss, micro_batch_size=1, bn="exact")
    _loss(stacked_big, (x, y)).backward()
    for p, q in zip(stacked_exact.parameters(), stacked_big.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_layer_norm_is_not_stackable_and_runs_alone():
    """A channels-first LayerNorm mixes channels: stacking it would mix runs, so it is refused."""
    models = _runs("ln")
    assert not stackable(models[0])
    assert all(stackable(m) for m in _runs("gn4"))
    with pytest.raises(ValueError, match="cannot be stacked"):
        StackedModel(models)
    x, _ = _data()
    torch.testing.assert_close(SingleRun(models[0])(x[:, :1])[:, 0], models[0](x[:, 0]))


def test_accumnorm_norm_names_validate_by_name_not_by_a_trial_width():
    """gn32 fits the study's widths (32..256); it was refused when checked by building it with 16 channels."""
    assert StudySettings(norms=("gn32", "bn-exact")).norms == ("gn32", "bn-exact")
    model = SimpleModel(norm_fn("gn32"), channels=(32, 64))
    assert [m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)] == [32, 32]


def test_unknown_norm_lists_study_and_accumnorm_names():
    with pytest.raises(ValueError, match=r"unknown norm 'bogus'.*bn-exact.*gn<G>"):
        norm_fn("bogus")


@pytest.mark.parametrize("name", ["bn", "gn16", "none"])
def test_deferred_conv_weight_gradients_equal_per_micro_batch_ones(name):
    """defer_weight_grads computes the same sum of per-micro-batch weight gradients in one call."""
    x, y = _data(n=6)
    grads = []
    for defer in (False, True):
        model = StackedModel(_runs(name), defer_weight_grads=defer).double()
        accumnorm.backward(model, (x.double(), y), _loss, micro_batch_size=2, bn="micro")
        model.flush_weight_grads()
        grads.append([p.grad for p in model.parameters()])
    assert not any(g.requires_grad for g in grads[1])  # plain gradients, no graph kept alive
    scale = max(float(g.abs().max()) for g in grads[0])
    for g0, g1 in zip(*grads):
        assert float((g1 - g0).abs().max()) <= 1e-10 * max(float(g0.abs().max()), 1e-2 * scale)


def test_stacked_evonorm_s0_keeps_its_groups_within_each_run():
    models, stacked = [], []
    for r in range(2):
        torch.manual_seed(r)
        models.append(SimpleModel(norm_fn("evonorm-s0"), channels=(32, 32, 64, 64)))
        with torch.no_grad():
            for m in models[-1].modules():
                if hasattr(m, "v"):
                    m.v.uniform_(0.5, 1.5)
    stacked = StackedModel(models)
    assert stacked.features[1].num_groups == 2 * 32
    x = torch.rand(4, 2, 1, 16, 16)
    out = stacked(x)
    for r, m in enumerate(models):
        torch.testing.assert_close(out[:, r], m(x[:, r]), rtol=1e-4, atol=1e-5)
