"""The models and data sets of ``ncina train``, and the ``module:factory`` plug-ins.

Every model is run forward and backward on two samples of its default data set; the parameter
counts are the architectures' (ResNet-20 0.27M, ResNet-18 11.2M and VGG-11 9.2M as published for
CIFAR). No download anywhere: the data sets are built on the machine.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from ncina.worker import data, models
from ncina.worker.training import loss_of, make_optimizer, recipe_of

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
    # the class structure: the templates (the same generator's first draw) classify the test
    # set by correlation, though each pixel's noise is ten times its template's signal
    patterns = data.templates(torch.Generator().manual_seed(5))
    images, truth = test.tensors
    assert images.std().item() == pytest.approx(1.0, abs=0.02)
    predicted = (images.flatten(1) @ patterns.flatten(1).T).argmax(1)
    assert (predicted == truth).float().mean().item() > 0.95


def test_a_recipe_scales_its_step_size_to_the_global_batch_and_warms_up() -> None:
    recipe = models.MODELS["vgg11"].recipe
    assert recipe.scaled(128) == replace(recipe, batch=None)
    assert recipe.scaled(32).lr == pytest.approx(recipe.lr / 4)
    assert models.MODELS["mlp"].recipe.scaled(32) == models.MODELS["mlp"].recipe  # no batch
    optimizer, schedule = make_optimizer(torch.nn.Linear(2, 2), models.Recipe(
        lr=0.02, momentum=0.5, weight_decay=1e-4, warmup_steps=4))  # fmt: skip
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx([0.005, 0.01, 0.015, 0.02, 0.02, 0.02])
    assert optimizer.param_groups[0]["momentum"] == 0.5
    assert optimizer.param_groups[0]["weight_decay"] == 1e-4


def test_the_flags_replace_the_recipe_and_lr_is_taken_as_given() -> None:
    args = argparse.Namespace(model="vgg11", workers=2, batch_size=32, lr=None, momentum=None,
                              weight_decay=0.0, warmup_steps=None)  # fmt: skip
    assert recipe_of(args) == models.Recipe(lr=0.01, momentum=0.9, weight_decay=0.0,
                                            warmup_steps=5)  # fmt: skip
    args.lr = 0.1
    assert recipe_of(args).lr == 0.1


@pytest.fixture
def one_thread() -> Iterator[None]:
    """PyTorch on one thread (as a rank of ncina train), restored after the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_image_recipe_trains_vgg11_from_its_first_steps() -> None:
    """VGG-11 on synthetic-images, one rank's batch of 32 a step with the recipe scaled to it,
    fixed seeds: the training loss falls by more than a third in 16 steps (measured: from 2.5
    to 1.2 over the first and last four; about 13 s on an idle core); at the unscaled 0.02 it
    rose to 5-10."""
    torch.manual_seed(0)
    net = models.vgg11()
    train, _ = data.synthetic_images(0)
    optimizer, schedule = make_optimizer(net, models.MODELS["vgg11"].recipe.scaled(32))
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(16):
        x, y = train[torch.randint(0, len(train), (32,), generator=generator)]
        optimizer.zero_grad()
        loss = loss_of(net(x), y)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.65 * first, losses


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
