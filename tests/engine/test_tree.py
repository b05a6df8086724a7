"""The step's one walk over the model's modules gives what torch's `named_modules` and `parameters` give."""
import torch.nn as nn
import torchvision

from accumnorm._engine.safety.tree import module_names, parameters


def _models():
    shared = nn.Linear(3, 3)
    tied = nn.Sequential(shared, nn.Sequential(shared, nn.ReLU(), nn.Sequential()), shared, nn.BatchNorm1d(3))
    tied.register_module("missing", None)
    return [torchvision.models.resnet18(), torchvision.models.densenet121(), tied]


def test_module_names_are_named_modules_in_order_each_once():
    for model in _models():
        assert list(module_names(model).items()) == [(m, name) for name, m in model.named_modules()]


def test_parameters_are_model_parameters_in_order_each_once():
    for model in _models():
        assert parameters(module_names(model)) == list(model.parameters())
