"""The models and data sets of ``ncina train``, and the ``module:factory`` plug-ins.

Every model is run forward and backward on two samples of its default data set; the parameter
counts are the architectures' (ResNet-20 0.27M, ResNet-18 11.2M and VGG-11 9.2M as published for
CIFAR). No download anywhere: the data sets are built on the machine.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from ncina.worker import data, models
from ncina.worker.training import loss_of

PARAMETERS = {
    "mlp": 17226, "cnn": 9930, "resnet20": 272474, "resnet18": 11173962, "vgg11": 9231114,
    "alexnet": 4361034, "transformer": 3307264,
}  # fmt: skip


@pytest.mark.parametrize("name", list(models.MODELS))
def test_each_model_trains_on_its_default_data(name: str) -> None:
    spec = models.MODELS[name]
    torch.manual_seed(0)
    net = spec.factory()
    assert sum(p.numel() for p in net.parameters()) == PARAMETERS[name]
    train, test = data.resolve(spec.data)(0)
    x, y = train[0:2]
    out = net(x)
    classes = models.VOCABULARY if name == "transformer" else models.CLASSES
    assert out.shape == (*y.shape, classes)
    loss = loss_of(out, y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in net.parameters())  # every parameter is a gradient
    assert len(test) > 0


def test_synthetic_images_are_learnable_and_reproducible() -> None:
    train, test = data.synthetic_images(5)
    again, _ = data.synthetic_images(5)
    assert torch.equal(train.tensors[0], again.tensors[0])
    assert len(train) == data.SYNTHETIC_TRAIN and len(test) == data.SYNTHETIC_TEST
    labels = train.tensors[1]
    assert labels.min() >= 0 and labels.max() < models.CLASSES
    assert len(torch.unique(labels)) == models.CLASSES  # every class occurs


def test_python_source_is_next_byte_prediction() -> None:
    train, test = data.python_source(0)
    x, y = train[3]
    assert x.shape == y.shape == (models.CONTEXT,)
    assert torch.equal(x[1:], y[:-1])  # the target is the input shifted by one byte
    text = data.corpus()
    start = 3 * (models.CONTEXT + 1)
    assert bytes(x.tolist()) == text[start : start + models.CONTEXT]
    assert len(test) == data.CORPUS_TEST_SAMPLES
    assert b"def " in text and b"import " in text  # it is Python source


def test_plug_in_model_and_data(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("my_workload")
    module.net = lambda: torch.nn.Linear(4, 3)  # type: ignore[attr-defined]
    module.sets = lambda seed: data.digits(seed)  # type: ignore[attr-defined]
    module.value = 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_workload", module)
    spec = models.resolve("my_workload:net")
    assert isinstance(spec.factory(), torch.nn.Linear) and spec.data == ""
    assert data.resolve("my_workload:sets") is module.sets  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no callable 'value'"):
        models.resolve("my_workload:value")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        data.resolve("no_such_module:sets")
    with pytest.raises(ValueError, match="unknown data set 'cifar'; data sets: digits"):
        data.resolve("cifar")
