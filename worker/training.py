"""The training loop of one rank of ``ncina train`` (DDP on digits; INA hook or gloo).

Kept apart from :mod:`ncina.worker.train` (the command's parser) so that building the ``ncina``
parser does not import PyTorch. See that module for what a run does and the events it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from ncina.worker import models
from ncina.worker.client import AllreduceClient
from ncina.worker.data import digits
from ncina.worker.sharding import ShardedAllreduce
from ncina.worker.torch_hook import InaHookState, VerifyingState, ina_hook, verifying_hook
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
# Client counters worth a line of progress (the rest go to the end event).
FABRIC_PROGRESS = ("packets_sent", "retransmissions", "timeouts", "saturated")


class Counters:
    """Deltas of an interface's counters since construction (zeros when no interface is given)."""

    def __init__(self, iface: str | None) -> None:
        self.paths = (
            {k: Path("/sys/class/net", iface, "statistics", k) for k in COUNTERS} if iface else {}
        )
        self.base = self._read()

    def _read(self) -> dict[str, int]:
        return {k: int(p.read_text()) for k, p in self.paths.items()}

    def delta(self) -> dict[str, int]:
        now = self._read()
        return {k: now[k] - self.base[k] for k in now}


class Clock:
    """Training time: runs except inside ``paused()``."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.paused_for = 0.0

    def __call__(self) -> float:
        return time.monotonic() - self.start - self.paused_for

    @contextmanager
    def pause(self) -> Iterator[None]:
        t = time.monotonic()
        yield
        self.paused_for += time.monotonic() - t


class Events:
    """Writes events as JSON lines (when a file is given) and progress lines on stdout."""

    def __init__(self, path: Path | None) -> None:
        self.file: TextIO | None = path.open("a") if path else None

    def emit(self, event: str, line: str | None = None, **fields: Any) -> None:
        if self.file:
            self.file.write(json.dumps({"event": event, **fields}) + "\n")
            self.file.flush()
        if line:
            print(line, flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()


def evaluate(model: nn.Module, test: TensorDataset) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (percent) on the whole test set."""
    x, y = test.tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train()
    loss = nn.functional.cross_entropy(logits, y).item()
    return loss, 100.0 * (logits.argmax(1) == y).float().mean().item()


def make_fabric(args: argparse.Namespace) -> ShardedAllreduce:
    """One client per aggregator; stochastic rounding seeded per rank (independent errors)."""
    return ShardedAllreduce(
        [
            AllreduceClient(
                agg, job=args.job, rank=args.rank, workers=args.world_size, k=args.k,
                pool_size=args.pool_size, window_max=args.window_max,
                result_format=args.result, seed=(args.seed << 16) + args.rank,
                deadline=args.deadline, compressor=args.compressor, mode=args.mode,
                key=args.key_file, mtu=args.mtu, data_path=args.data_path,
            )
            for agg in args.ina
        ]
    )


def run_rank(args: argparse.Namespace) -> None:
    """Join the process group and train (``args``: ``ncina train``'s options).

    Errors (unknown model, aggregator gone, NaN gradients) raise.
    """
    models.check(args.model)
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # several ranks share the machine's cores
    host, port = args.master
    dist.init_process_group(
        "gloo", init_method=f"tcp://{host}:{port}", rank=args.rank,
        world_size=args.world_size, timeout=timedelta(seconds=120),
    )
    events = Events(args.metrics)
    fabric = make_fabric(args) if args.ina else None
    try:
        train(args, events, fabric)
    finally:
        if fabric:
            fabric.close()
        events.close()
        dist.destroy_process_group()


def train(args: argparse.Namespace, events: Events, fabric: ShardedAllreduce | None) -> None:
    """The training loop of one rank (see the module doc for the events it emits)."""
    train_set, test_set = digits(args.seed)
    model = DistributedDataParallel(models.MODELS[args.model](), bucket_cap_mb=args.bucket_cap_mb)
    verify: VerifyingState | None = None
    if fabric:
        state = InaHookState(fabric)
        if args.verify:
            verify = VerifyingState(state)
            model.register_comm_hook(verify, verifying_hook)
        else:
            model.register_comm_hook(state, ina_hook)
    sampler = DistributedSampler(
        train_set, num_replicas=args.world_size, rank=args.rank, seed=args.seed, drop_last=True
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    mode = "ina" if fabric else "gloo"
    tag = f"[{mode} rank {args.rank}]"
    params = sum(p.numel() for p in model.parameters())
    test_loss, test_acc = evaluate(model.module, test_set)
    dist.barrier()  # every rank starts its counters and clock together
    counters, clock = Counters(args.iface), Clock()
    events.emit(
        "start", f"{tag} {args.model}, {params} parameters, {len(loader)} steps/epoch",
        rank=args.rank, world_size=args.world_size, mode=mode, model=args.model,
        parameters=params, steps_per_epoch=len(loader), aggregators=len(args.ina),
        compressor=args.compressor, fabric_mode=args.mode if fabric else None,
        test_loss=test_loss, test_acc=test_acc,
    )
    step = 0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            now, wire, value = clock(), counters.delta(), loss.item()
            progress = {k: v for k, v in (fabric.stats if fabric else {}).items()
                        if k in FABRIC_PROGRESS}
            line = None
            if step % args.log_every == 0:
                extra = "".join(f" {k}={v}" for k, v in progress.items())
                line = (f"{tag} epoch {epoch} step {step} loss {value:.4f} "
                        f"tx {wire.get('tx_bytes', 0)} B{extra} t {now:.2f} s")
            events.emit("step", line, step=step, epoch=epoch, loss=value, time=now, **wire,
                        fabric=progress)
            if verify:
                for record in verify.records:
                    events.emit("verify", step=step, **record)
                verify.records.clear()
            if step == args.max_steps:
                break
        elapsed, wire = clock(), counters.delta()
        with clock.pause():
            test_loss, test_acc = evaluate(model.module, test_set)
        events.emit(
            "epoch",
            f"{tag} epoch {epoch} done: test loss {test_loss:.4f} accuracy {test_acc:.2f}% "
            f"t {elapsed:.2f} s tx {wire.get('tx_bytes', 0)} B",
            epoch=epoch, step=step, time=elapsed, test_loss=test_loss, test_acc=test_acc, **wire,
        )
        if step == args.max_steps:
            break
    dist.barrier()
    events.emit(
        "end", f"{tag} finished: {step} steps, accuracy {test_acc:.2f}%",
        steps=step, epochs=epoch, time=clock(), test_acc=test_acc, test_loss=test_loss,
        **counters.delta(), fabric=fabric.stats if fabric else {},
    )
