"""The training loop of one rank of ``ncina train`` (DDP; INA hook or gloo).

Kept apart from :mod:`ncina.worker.train` (the command's parser) so that building the ``ncina``
parser does not import PyTorch. See that module for what a run does and the events it writes.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from ncina.proto.job import JobSpec
from ncina.worker import data, models, tuning
from ncina.worker.client import AllreduceClient
from ncina.worker.sharding import ShardedAllreduce
from ncina.worker.torch_hook import (
    GlooHookState,
    InaHookState,
    VerifyingState,
    gloo_hook,
    ina_hook,
    verifying_hook,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ncina.common import cpu
from ncina.common.htb import LinkCounters

# Client counters worth a line of progress (the rest go to the end event).
FABRIC_PROGRESS = ("packets_sent", "retransmissions", "timeouts", "saturated")


class Clock:
    """Training time, and the CPU time training costs: both run except inside ``pause()``.

    The CPU time is this process's (every thread: the compute and, with the INA hook, its
    communication thread and the C data path; with gloo, gloo's threads) and the CPU time no
    process was charged, where the kernel's packet work on idle CPUs and in ksoftirqd goes
    (``ncina.common.cpu.unattributed_s``: each CPU-second counted once; machine-wide, so every
    rank sees about the same figure, an upper bound on a shared machine)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.paused_for = 0.0
        self.cpu_start, self.machine_start = self._cpu()
        self.cpu_paused = self.unattributed_paused = 0.0

    @staticmethod
    def _cpu() -> tuple[float, dict[str, Any]]:
        return cpu.process_cpu_s(os.getpid()), cpu.snapshot()

    def __call__(self) -> float:
        return time.monotonic() - self.start - self.paused_for

    def cpu_s(self) -> float:
        """This process's CPU-seconds since the start, pauses excluded."""
        return self._cpu()[0] - self.cpu_start - self.cpu_paused

    def unattributed_s(self) -> float:
        """The CPU-seconds no process was charged since the start, pauses excluded."""
        now = self._cpu()[1]
        return max(0.0, cpu.unattributed_s(self.machine_start, now) - self.unattributed_paused)

    @contextmanager
    def pause(self) -> Iterator[None]:
        t, (used, machine) = time.monotonic(), self._cpu()
        yield
        self.paused_for += time.monotonic() - t
        now_used, now_machine = self._cpu()
        self.cpu_paused += now_used - used
        self.unattributed_paused += cpu.unattributed_s(machine, now_machine)


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


EVAL_BATCH = 256
PROBE_STEPS = 3  # compute-only steps (no gradient exchange) timed before training


def loss_of(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the last axis of ``output`` (image logits ``(B, C)`` or LM logits
    ``(B, T, V)``), every other axis a sample."""
    return nn.functional.cross_entropy(output.flatten(0, -2), target.flatten(),
                                       reduction=reduction)  # fmt: skip


def resolve_device(name: str, rank: int, environ: Mapping[str, str]) -> torch.device:
    """The device this rank trains on (``--device``): ``cpu``; ``cuda:N`` as given; ``cuda``:
    GPU ``$LOCAL_RANK`` (torchrun's rank on this node), else the rank, modulo the GPU count.
    ``ValueError`` when PyTorch sees no such CUDA GPU (before anything else starts)."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: PyTorch {torch.__version__} sees no CUDA GPU here")
    count = torch.cuda.device_count()
    if name == "cuda":
        return torch.device("cuda", int(environ.get("LOCAL_RANK", rank)) % count)
    index = int(name.removeprefix("cuda:"))
    if index >= count:
        raise ValueError(f"--device {name}: PyTorch sees {count} CUDA GPU(s)")
    return torch.device("cuda", index)


def evaluate(model: nn.Module, test: Dataset, device: torch.device) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (percent, per predicted class: per image, or per next
    character of an LM) on the whole test set, in batches."""
    model.eval()
    loss = correct = count = 0.0
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=EVAL_BATCH):
            x, y = x.to(device), y.to(device)
            output = model(x)
            loss += loss_of(output, y, "sum").item()
            correct += (output.argmax(-1) == y).sum().item()
            count += y.numel()
    model.train()
    return loss / count, 100.0 * correct / count


def compute_step_time(
    model: DistributedDataParallel, loader: DataLoader, device: torch.device
) -> float:
    """Median seconds of a forward and backward pass without gradient exchange (``no_sync``):
    the compute a step costs (``step_s`` beyond it is what the exchange adds to a step, its
    share of the CPUs included). The gradients are discarded, and the parameters stay as they
    are."""
    times = []
    batches = iter(loader)
    with model.no_sync():
        for _ in range(PROBE_STEPS):
            x, y = next(batches)
            start = time.perf_counter()
            loss_of(model(x.to(device)), y.to(device)).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the kernels ran, not only were queued
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def recipe_of(args: argparse.Namespace) -> models.Recipe:
    """The model's recipe (``ncina.worker.models``) for the run's global batch (``--workers``
    x ``--batch-size``), with the flags given in its place (``--lr`` as given, unscaled)."""
    recipe = models.resolve(args.model).recipe.scaled(args.workers * args.batch_size)
    given = {name: getattr(args, name, None)
             for name in ("lr", "momentum", "weight_decay", "warmup_steps")}  # fmt: skip
    return replace(recipe, **{k: v for k, v in given.items() if v is not None})


def make_optimizer(
    model: nn.Module, recipe: models.Recipe
) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.LambdaLR]:
    """SGD as ``recipe`` says, and its schedule (stepped after every optimizer step): the step
    size rises linearly to ``recipe.lr`` over ``recipe.warmup_steps`` steps, then stays."""
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum,
                                weight_decay=recipe.weight_decay)  # fmt: skip
    warmup = max(1, recipe.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup))
    return optimizer, schedule


def make_fabric(args: argparse.Namespace, job: JobSpec) -> ShardedAllreduce:
    """One client per aggregator for the ``job`` of the flags (``ncina.worker.train.job_spec``);
    stochastic rounding seeded per rank (independent errors). With ``--leaf-workers W`` the
    aggregator is a leaf of W of the ranks (hierarchical aggregation): this rank is its rank
    ``RANK mod W``, and the job's total the world size. Server mode: ``--k`` as given (the
    compressor's payloads bound it)."""
    leaf = args.leaf_workers
    server_k = {"k": args.k} if args.mode == "server" else {}
    return ShardedAllreduce(
        [
            AllreduceClient.for_job(
                agg, job, rank=args.rank % leaf if leaf else args.rank, **server_k,
                seed=(args.seed << 16) + args.rank, deadline=args.deadline,
                compressor=args.compressor, mode=args.mode, data_path=args.data_path,
                cwnd=args.cwnd, handshake_timeout=args.handshake_timeout or None,
            )
            for agg in args.aggregator
        ]
    )


def run_rank(args: argparse.Namespace, job: JobSpec) -> None:
    """Join the process group and train (``args``: ``ncina train``'s options, ``job``: their
    job, ``ncina.worker.train.job_spec``).

    Errors (unknown model, aggregator gone, NaN gradients) raise.
    """
    models.check(args.model)
    device = resolve_device(args.device, args.rank, os.environ)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # several ranks share the machine's cores
    # torchrun's workers join its agent's store (env://); otherwise rank 0 listens at --master.
    init = "env://" if args.master is None else "tcp://{}:{}".format(*args.master)
    backend = getattr(args, "backend", "gloo")
    dist.init_process_group(
        backend, init_method=init, rank=args.rank, world_size=args.workers,
        timeout=timedelta(seconds=120), pg_options=backend_options(args, job),
    )
    # Under torchrun every rank gets the same flags: "{rank}" in the path keeps their files apart.
    events = Events(Path(str(args.metrics).format(rank=args.rank)) if args.metrics else None)
    fabric = make_fabric(args, job) if args.aggregator and backend == "gloo" else None
    try:
        train(args, events, fabric, device)
    finally:
        if fabric:
            fabric.close()
        events.close()
        release_ddp()


def backend_options(args: argparse.Namespace, job: JobSpec) -> Any:
    """``--backend ncina``: the job's options for the process group (the aggregators, job and
    client parameters of the flags); gloo: None. No exact threshold: DDP's only float
    all-reduces are its gradient buckets, which the hook path compresses too, whatever their
    size (a cnn's one bucket is below the backend's default)."""
    if getattr(args, "backend", "gloo") != "ncina":
        return None
    from ncina.worker.torch_backend import NcinaOptions

    return NcinaOptions.for_job(list(args.aggregator), job, deadline=args.deadline,
                                seed=args.seed, exact_below=0)  # fmt: skip


def backend_stats() -> tuple[dict[str, float], dict[str, int]]:
    """With ``--backend ncina``: the process group's client counters (and ``comm_total_s``,
    the seconds inside its INA all-reduces) and its path counts; empty ones otherwise."""
    from ncina.worker import torch_backend

    group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, torch_backend.NcinaProcessGroup) or group.state is None:
        return {}, {}
    stats = {**group.state.fabric.stats, "comm_total_s": group.state.comm_total_s}
    return stats, torch_backend.paths(group)


def release_ddp() -> None:
    """Free the DDP models nobody references any more, then leave the process group.

    A DDP model's reducer holds the process group, and its reference cycles keep it alive until
    the garbage collector runs; left to the interpreter's exit, gloo's threads were torn down
    after Python and the process died of SIGABRT ("terminate called without an active
    exception") in about one run of ten.
    """
    gc.collect()
    dist.destroy_process_group()


def train(
    args: argparse.Namespace,
    events: Events,
    fabric: ShardedAllreduce | None,
    device: torch.device,
) -> None:
    """The training loop of one rank on ``device`` (see the module doc for the events it
    emits); on a GPU the INA hook stages the buckets through pinned host memory."""
    spec = models.resolve(args.model)
    data_name = args.data or spec.data
    if not data_name:
        raise ValueError(f"--model {args.model} has no default data set: give --data")
    train_set, test_set = data.resolve(data_name)(args.seed)
    model = DistributedDataParallel(
        spec.factory().to(device), device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb or tuning.bucket_cap_mb(args.link_mbit),
    )
    verify: VerifyingState | None = None
    hook: InaHookState | GlooHookState | None = None
    if getattr(args, "backend", "gloo") == "ncina":
        pass  # no comm hook: DDP's own all-reduce goes to the ncina process group
    elif fabric:
        # The per-bucket agreement gets a gloo group of its own (torch_hook's module doc).
        hook = InaHookState(fabric, fallback=args.fallback, group=dist.new_group(backend="gloo"))
        if args.verify:
            verify = VerifyingState(hook)
            model.register_comm_hook(verify, verifying_hook)
        else:
            model.register_comm_hook(hook, ina_hook)
    else:
        hook = GlooHookState()
        model.register_comm_hook(hook, gloo_hook)
    try:
        steps(args, events, fabric, model, hook, verify, train_set, test_set, data_name, device)
    finally:
        if isinstance(hook, InaHookState):
            hook.close()


def steps(
    args: argparse.Namespace,
    events: Events,
    fabric: ShardedAllreduce | None,
    model: DistributedDataParallel,
    hook: InaHookState | GlooHookState | None,
    verify: VerifyingState | None,
    train_set: Dataset,
    test_set: Dataset,
    data_name: str,
    device: torch.device,
) -> None:
    """Train ``model`` (on ``device``) for the epochs or steps asked, emitting the events."""
    sampler = DistributedSampler(
        train_set, num_replicas=args.workers, rank=args.rank, seed=args.seed, drop_last=True
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    recipe = recipe_of(args)
    optimizer, schedule = make_optimizer(model, recipe)
    mode = "ina" if fabric else "ncina" if hook is None else "gloo"
    tag = f"[{mode} rank {args.rank}]"
    params = sum(p.numel() for p in model.parameters())
    test_loss, test_acc = evaluate(model.module, test_set, device)
    compute_s = compute_step_time(model, loader, device)
    dist.barrier()  # every rank starts its counters and clock together
    counters, clock = LinkCounters(args.iface), Clock()
    events.emit(
        "start", f"{tag} {args.model} on {data_name}, {params} parameters, "
        f"{len(loader)} steps/epoch, compute {compute_s * 1e3:.1f} ms/step",
        rank=args.rank, world_size=args.workers, mode=mode, model=args.model,
        data=data_name, device=str(device), parameters=params, steps_per_epoch=len(loader),
        aggregators=len(args.aggregator), compressor=args.compressor,
        fabric_mode=args.mode if fabric else None, test_loss=test_loss, test_acc=test_acc,
        compute_step_s=compute_s, recipe=asdict(recipe),
    )
    step = 0
    announced = False  # the fallback to gloo, once
    step_total = 0.0  # seconds inside steps (forward, backward with the exchange, update)
    comm_wait = 0.0  # seconds backward() went on after this rank's last bucket was ready
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            started = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_of(model(x), y)
            try:
                loss.backward()  # returns once every bucket's all-reduce has completed
            except RuntimeError as exc:  # DDP's wrapping of a failed all-reduce: say what failed
                if isinstance(hook, InaHookState) and hook.error is not None:
                    raise hook.error from exc
                raise
            if isinstance(hook, InaHookState) and hook.fallen_back and not announced:
                announced = True
                events.emit("fallback", f"{tag} the INA all-reduce failed ({hook.fallen_back}); "
                            "training goes on through gloo", step=step + 1,
                            reason=hook.fallen_back)  # fmt: skip
            comm_done = time.time()
            # Without a hook (--backend ncina) nothing says when the gradients were ready.
            times = {} if hook is None else {"grads_ready": hook.last_call, "comm_done": comm_done}
            comm_wait += comm_done - times.get("grads_ready", comm_done)
            optimizer.step()
            schedule.step()
            step_total += time.perf_counter() - started
            step += 1
            now, value = clock(), loss.item()
            with clock.pause():  # a tc process: the counters' time is not training's
                wire = counters.delta()
            progress = {k: v for k, v in (fabric.stats if fabric else {}).items()
                        if k in FABRIC_PROGRESS}
            line = None
            if step % args.log_every == 0:
                extra = "".join(f" {k}={v}" for k, v in progress.items())
                line = (f"{tag} epoch {epoch} step {step} loss {value:.4f} "
                        f"tx {wire.get('tx_bytes', 0)} B{extra} t {now:.2f} s")
            events.emit("step", line, step=step, epoch=epoch, loss=value, time=now, **wire,
                        fabric=progress, **times)
            if verify:
                for record in verify.records:
                    events.emit("verify", step=step, **record)
                verify.records.clear()
            if step == args.max_steps:
                break
        elapsed, wire = clock(), counters.delta()
        with clock.pause():
            test_loss, test_acc = evaluate(model.module, test_set, device)
        events.emit(
            "epoch",
            f"{tag} epoch {epoch} done: test loss {test_loss:.4f} accuracy {test_acc:.2f}% "
            f"t {elapsed:.2f} s tx {wire.get('tx_bytes', 0)} B",
            epoch=epoch, step=step, time=elapsed, test_loss=test_loss, test_acc=test_acc, **wire,
            parameters_sha256=parameters_digest(model),
        )
        if step == args.max_steps:
            break
    # A restart that lost a rank's last bucket: the others' hook probers ask the aggregators
    # while they wait here, and serve it (docs/reliability.md, "A rank that waits between calls").
    dist.barrier()
    elapsed = clock()
    timing = step_timing(step, step_total, compute_s, comm_wait, hook)
    backend_fabric, backend_paths = backend_stats()
    samples_per_s = step * args.batch_size * args.workers / elapsed if elapsed else 0.0
    events.emit(
        "end", f"{tag} finished: {step} steps, accuracy {test_acc:.2f}%, "
        f"{samples_per_s:.1f} samples/s, exposed communication "
        f"{timing['exposed_comm_s'] or 0:.2f} s of {timing['step_s'] * step:.2f} s",
        steps=step, epochs=epoch, time=elapsed, test_acc=test_acc, test_loss=test_loss,
        samples_per_s=samples_per_s, **timing, **counters.delta(),
        cpu_s=clock.cpu_s(), unattributed_s=clock.unattributed_s(),
        fabric=fabric.stats if fabric else backend_fabric, paths=backend_paths,
        parameters_sha256=parameters_digest(model),
        fallback=hook.fallen_back if isinstance(hook, InaHookState) else "",
        fallback_buckets=hook.fallback_buckets if isinstance(hook, InaHookState) else 0,
    )


def parameters_digest(model: nn.Module) -> str:
    """SHA-256 of the model's parameters, bytes in order: equal on every rank exactly when
    the ranks hold bit-identical parameters."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def step_timing(
    steps: int,
    step_total: float,
    compute_s: float,
    comm_wait: float,
    hook: InaHookState | GlooHookState | None,
) -> dict[str, float | None]:
    """What a training run's steps cost on this rank: ``step_s`` (mean), ``compute_step_s``
    (the probe's), ``exposed_comm_s`` (``comm_wait``: over all steps, how long the backward
    pass went on after this rank's last bucket was handed over, i.e. the communication its
    compute did not hide, waiting for slower ranks included), ``comm_total_s`` (time inside
    the INA hook's all-reduces; None for gloo, whose all-reduces run inside gloo) and
    ``exposed_comm_fraction`` (exposed over total communication; None for gloo). Without a
    hook (``--backend ncina``) the exposed communication is not measured (None)."""
    comm = hook.comm_total_s if isinstance(hook, InaHookState) else None
    return {
        "step_s": step_total / steps if steps else 0.0,
        "compute_step_s": compute_s,
        "exposed_comm_s": None if hook is None else comm_wait,
        "comm_total_s": comm,
        "exposed_comm_fraction": min(1.0, comm_wait / comm) if comm else None,
    }
