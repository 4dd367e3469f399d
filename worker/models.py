"""The models ``ncina train`` can train, each with the data set it trains on by default.

- ``mlp``, ``cnn``: small nets for the 8x8 digits images (about 17K and 10K parameters): a
  whole training run takes seconds on two cores, for ``make topo`` and the tests.
- ``resnet20`` (0.27M parameters), ``resnet18`` (11.2M, the CIFAR variant: 3x3 stem, no
  max-pool), ``vgg11`` (9.2M, communication-heavy: most parameters sit in a few layers with little
  compute), ``alexnet`` (a CIFAR-sized AlexNet, 4.4M): 3x32x32 images, 10 classes, trained on
  synthetic data by default (throughput, as Horovod's synthetic benchmark does).
- ``transformer``: a small character-level language model (4 layers, width 256, 3.3M parameters)
  over the bytes of text, trained on the Python standard library's sources by default (a real
  corpus that is on every machine: accuracy is next-character accuracy).

Every model maps a batch to logits whose last axis is the class (image: ``(B, classes)``; LM:
``(B, T, vocabulary)``); the training loop flattens both the same way. A user's own model plugs
in as ``--model module:factory`` (a function of no arguments returning an ``nn.Module``), with
``--data module:factory`` (see :mod:`ncina.worker.data`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

CLASSES = 10
VOCABULARY = 256  # the LM reads bytes
CONTEXT = 64  # characters per LM sample


def mlp() -> nn.Module:
    """64 -> 128 -> 64 -> 10, ReLU (about 17K parameters)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


def cnn() -> nn.Module:
    """Two 3x3 convolutions (16, 32 channels), 2x2 max-pool, linear head (about 10K parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, CLASSES),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False),
            nn.BatchNorm2d(outputs),
            nn.ReLU(inplace=True),
            nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False),
            nn.BatchNorm2d(outputs),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _resnet(widths: tuple[int, ...], blocks: int) -> nn.Module:
    """A CIFAR ResNet: a 3x3 stem, ``blocks`` basic blocks per stage (stride 2 between stages),
    global average pooling and a linear head."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU(inplace=True),
    ]
    inputs = widths[0]
    for stage, width in enumerate(widths):
        for block in range(blocks):
            layers.append(BasicBlock(inputs, width, 2 if stage and not block else 1))
            inputs = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, CLASSES)]
    return nn.Sequential(*layers)


def resnet20() -> nn.Module:
    """ResNet-20 for CIFAR (He et al.): 3 stages of 16, 32, 64 channels, 3 blocks each."""
    return _resnet((16, 32, 64), 3)


def resnet18() -> nn.Module:
    """ResNet-18, CIFAR variant: 4 stages of 64..512 channels, 2 blocks each."""
    return _resnet((64, 128, 256, 512), 2)


def vgg11() -> nn.Module:
    """VGG-11 (configuration A) for 32x32 inputs, with batch norm and a 512 -> 10 head."""
    plan = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
    layers: list[nn.Module] = []
    inputs = 3
    for item in plan:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        layers += [nn.Conv2d(inputs, int(item), 3, padding=1), nn.BatchNorm2d(int(item)),
                   nn.ReLU(inplace=True)]  # fmt: skip
        inputs = int(item)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512, CLASSES))


def alexnet() -> nn.Module:
    """An AlexNet for 32x32 inputs: five convolutions (64..256 channels), three max-pools and
    two 1024-wide fully connected layers (most of its parameters)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, 2, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(256 * 2 * 2, 1024), nn.ReLU(inplace=True),
        nn.Linear(1024, 1024), nn.ReLU(inplace=True),
        nn.Linear(1024, CLASSES),
    )  # fmt: skip


class CharTransformer(nn.Module):
    """A causal transformer over bytes: embedding plus learned positions, pre-norm encoder
    layers with a causal mask, and a head tied to no weight (every parameter is a gradient)."""

    def __init__(self, width: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCABULARY)
        mask = torch.triu(torch.full((CONTEXT, CONTEXT), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position[:t]
        h = self.encoder(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def transformer() -> nn.Module:
    """The small character-level LM (:class:`CharTransformer`)."""
    return CharTransformer()


@dataclass(frozen=True)
class Recipe:
    """How a model trains unless ``ncina train``'s flags say otherwise: SGD with ``lr`` and
    ``momentum``, L2 ``weight_decay``, and a linear warm-up of the step size from
    ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps`` steps (0: none), then
    constant. With ``batch``, ``lr`` is the step size for a global batch (all ranks' samples of
    a step) of that many samples, scaled linearly to the run's (:meth:`scaled`)."""

    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int = 0
    batch: int | None = None

    def scaled(self, global_batch: int) -> Recipe:
        """This recipe for a global batch of ``global_batch`` samples: with ``batch``, the step
        size times ``global_batch / batch`` (the linear scaling rule of Goyal et al., "Accurate,
        Large Minibatch SGD", 2017: a batch k times larger averages away k times the gradient
        noise, so it takes a step k times longer; the warm-up keeps the first, large steps
        stable); without, unchanged."""
        if self.batch is None:
            return self
        return replace(self, lr=self.lr * global_batch / self.batch, batch=None)


SMALL = Recipe()
"""The digits nets and the LM: SGD 0.1 with momentum 0.9 learns them within an epoch."""

IMAGES = Recipe(lr=0.02, momentum=0.9, weight_decay=5e-4, warmup_steps=5, batch=128)
"""The 32x32 image nets (VGG-11, ResNets, AlexNet) from their first steps, as ``ncina bench
ddp`` runs them (4 ranks x 32 images a step). VGG-11 on ``synthetic-images`` (measured on one
core: a step of 4 x 32 images, as 4 ranks' averaged gradients, with or without NC8's rounding of
every rank's gradient and of their mean): at 0.1 with no warm-up it diverged in three steps
(test loss 2.4e3, one class; on the fabric 1.2e6 after 10 steps); at 0.02 after a 5-step
warm-up its training loss falls from 2.7 to 0.34 in 20 steps, 88 % test accuracy with fp32
gradients and 90 % with NC8. One rank of 32 images at the same 0.02 diverged (loss 5-10 by
step 8): its gradients are twice as noisy, hence the scaling to the global batch (0.005 for 32:
the loss falls from 2.6 to 1.0 in 16 steps; tests/test_models.py). Weight decay 5e-4 is the
usual CIFAR setting."""


@dataclass(frozen=True)
class Model:
    """A model factory, the data set it trains on unless ``--data`` says otherwise, and the
    recipe it trains with unless the flags say otherwise."""

    factory: Callable[[], nn.Module]
    data: str
    recipe: Recipe = SMALL


MODELS: dict[str, Model] = {
    "mlp": Model(mlp, "digits"),
    "cnn": Model(cnn, "digits"),
    "resnet20": Model(resnet20, "synthetic-images", IMAGES),
    "resnet18": Model(resnet18, "synthetic-images", IMAGES),
    "vgg11": Model(vgg11, "synthetic-images", IMAGES),
    "alexnet": Model(alexnet, "synthetic-images", IMAGES),
    "transformer": Model(transformer, "python-source"),
}


def load_factory(spec: str, what: str) -> Callable[..., object]:
    """The callable ``module:name`` names (a user's plug-in); ``ValueError`` saying what failed."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{what} {spec!r} is neither a known name nor module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{what} {spec!r}: {module_name} has no callable {name!r}")
    return factory


def resolve(name: str) -> Model:
    """The model ``--model`` names: one of ``MODELS``, or ``module:factory`` (a plug-in, which
    has no default data set: ``data`` is empty and ``--data`` must name one). ``ValueError``
    otherwise."""
    if name in MODELS:
        return MODELS[name]
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}; models: {', '.join(MODELS)}, or module:factory")
    return Model(load_factory(name, "model"), "")  # type: ignore[arg-type]


def check(name: str) -> None:
    """Raise ``ValueError`` naming the models when ``name`` is not one of them."""
    resolve(name)
