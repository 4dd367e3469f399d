"""What a topology run depends on: :class:`TopoConfig` (no Mininet or PyTorch import here, so the
``ncina topo`` parser can show its defaults cheaply)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ncina.aggregator.backends import names
from ncina.proto.header import Format, largest_k
from ncina.proto.job import JobSpec
from ncina.proto.profiles import DEFAULT

BMV2_POOL_SIZE = 8
"""The bmv2 backend's default pool: the best of the pools measured in training through the
switch (8 and 16 at K = 64, 128 and 256: docs/bmv2.md, "The topology's K and pool"); a larger
one only queues more frames behind the switch and times more of them out."""

FIXED_K = 256
"""K where the MTU does not decide it: on BMv2, whose P4 lanes are compiled per K, the best
measured in training through the switch (64, 128 and 256: docs/bmv2.md, "The topology's K and
pool"; K = 256 compiles in about 2 minutes of CPU and 1.1 GB once), and in server mode, where a
compressor's payload of K elements must fit a frame. Elsewhere ``ncina topo`` takes the largest
K for MTU 1500."""

JOB = 1
"""The job id of every topology run."""
DEFAULT_JOB = JobSpec(job=JOB, workers=4, k=FIXED_K)
"""A topology run's job when none is given (``TopoConfig.job``): its default fields, K
``FIXED_K``; ``ncina topo``'s defaults."""


# Backends whose frames the aggregator host's netfilter never sees (the DPDK port takes them
# first; with the P4 switch there is no aggregator host): a worker's uplink loss is dropped as
# it leaves the worker instead (StarTopo's uplink_at_worker).
UPLINK_LOSS_AT_WORKER = ("dpdk", "bmv2")
# Backends whose aggregator reads a kernel UDP socket, which takes a GSO run whole or cut
# (TopoConfig's offloads).
OFFLOAD_BACKENDS = names(kernel_sockets=True)


def offloads_allowed(topo: str, loss: float, backend: str | None) -> bool:
    """Whether a topology's links may have their checksum offloads on (TopoConfig's offloads):
    a star without loss (an iptables rule would drop a whole GSO run) whose aggregator reads a
    kernel UDP socket (DPDK's af_packet and BMv2 take frames, not GSO runs)."""
    return topo == "star" and not loss and backend in OFFLOAD_BACKENDS


@dataclass
class TopoConfig:
    """Everything a topology run depends on (recorded in results.json as ``config``).

    topo: ``star``, ``multi`` or ``leafspine`` (``leaves`` leaf aggregators of ``workers /
    leaves`` workers and a spine: python, socket or dpdk backend, INA mode, a K whose int
    partial sums fit ``mtu``); bw: Mbit/s per worker link (None: unshaped); agg_bw: the same
    per aggregator link (None: unshaped, the aggregators stand in for the switch); loss: percent
    per worker link direction;
    batch_size: per worker; bucket_cap_mb: DDP's gradient bucket
    size (smaller buckets start their exchange earlier in the backward pass);
    job: the run's job (``ncina.proto.job.JobSpec``) as every worker holds it, every field of it
    given to every aggregator and worker (``JobSpec.to_args``; a leaf-spine's aggregators hold
    it with their own workers, total workers and uplink); its ``workers`` are the topology's,
    its ``mtu`` every link's, its key travels as ``key_file`` (None: ``DEFAULT_JOB`` of
    ``workers``);
    compressor: the workers' gradient compressor spec (None: NC8 of the raw gradients) and mode
    where the sum is made, ``ina`` or ``server`` (the aggregators then run the same spec);
    key_file: the job's shared secret (hex) for the authentication tag, given to the aggregators
    and the workers (None: untagged);
    verify: check every INA result against gloo (extra traffic); baseline: also train with gloo
    fp32; torch_backend: also train through the ncina process-group backend (DDP with no hook,
    ``ncina train --backend ncina``) beside the hook; repeat: training runs per mode on the
    same network (medians and spread reported);
    profile: not the job's (``job.profile``) but a run's: ``tofino`` trains once more under it,
    beside the job's run (BMv2: under it only, the switch runs the Tofino program's twin), with
    int32 results, K of at most the design's lanes and a pool of ``profile_pool_size``;
    timeout: seconds one training run may take; prefix: of node and interface names (unique per
    process); offloads: the links' checksum offloads on, so that UDP GSO runs cross the fabric
    whole (``ncina.topo.topos.link_options``: a star on kernel sockets without loss only,
    :func:`offloads_allowed`); None: on where allowed (``ncina topo``'s and ``ncina bench
    fabric``'s default), off elsewhere.
    """

    out: Path
    topo: str = "star"
    workers: int = 4
    aggregators: int = 1
    leaves: int = 2
    backend: str | None = None  # None: socket, or python in server mode (__post_init__)
    bw: float | None = None
    agg_bw: float | None = None
    loss: float = 0.0
    model: str = "mlp"
    epochs: int = 10
    max_steps: int | None = None
    batch_size: int = 32
    bucket_cap_mb: float = 25.0
    lr: float | None = None  # None: the model's recipe (ncina.worker.models)
    seed: int = 0
    job: JobSpec | None = None  # None: DEFAULT_JOB of the workers (__post_init__)
    compressor: str | None = None
    mode: str = "ina"
    key_file: Path | None = None
    verify: bool = False
    pcaps: bool = False
    baseline: bool = True
    torch_backend: bool = False
    repeat: int = 1
    timeout: float = 3600.0
    prefix: str = field(default_factory=lambda: f"n{os.getpid() % 100000}")
    offloads: bool | None = False
    profile: str = DEFAULT
    profile_pool_size: int | None = None

    def __post_init__(self) -> None:
        if self.job is None:
            self.job = replace(DEFAULT_JOB, workers=self.workers)
        if self.job.workers != self.workers:
            raise ValueError(f"the job has {self.job.workers} workers, the topology "
                             f"{self.workers}")  # fmt: skip
        # The C backends serve INA mode; server mode (decompress, average, re-compress) is the
        # Python backend's.
        if self.backend is None:
            self.backend = "python" if self.mode == "server" or self.topo == "leafspine" else (
                "socket"
            )
        if self.topo == "leafspine":
            self.check_leafspine()
        allowed = offloads_allowed(self.topo, self.loss, self.backend)
        if self.offloads is None:
            self.offloads = allowed
        if self.offloads and not allowed:
            raise ValueError("offloads: a star without loss on kernel sockets only (backends "
                             f"{', '.join(OFFLOAD_BACKENDS)}): DPDK's af_packet and BMv2 take "
                             "frames, not GSO runs")  # fmt: skip
        if self.torch_backend and (self.compressor or self.topo == "leafspine" or self.verify):
            raise ValueError("the ncina backend's run (torch_backend) takes no compressor, "
                             "leaf-spine topology nor verify: those are the comm hook's")

    def check_leafspine(self) -> None:
        """Raise ``ValueError`` unless the leaf-spine run can work: python, socket or dpdk
        backend, INA mode (docs/protocol.md, "Hierarchical aggregation"), workers split evenly,
        int frames of K."""
        if self.backend not in ("python", "socket", "dpdk") or self.mode != "ina":
            raise ValueError(f"--topo leafspine runs the python, socket or dpdk backend in INA "
                             f"mode, not BACKEND={self.backend} --mode {self.mode}: the P4 data "
                             "plane carries no int partial sums, server mode sums "
                             "floats")  # fmt: skip
        if self.pcaps:
            raise ValueError("--pcaps captures the star's aggregator links: not in leafspine yet")
        if not 1 <= self.leaves <= self.workers or self.workers % self.leaves:
            raise ValueError(f"--leaves {self.leaves}: the {self.workers} workers must split "
                             "evenly over the leaves")  # fmt: skip
        job = self.job
        largest = largest_k(job.mtu, Format.INT, self.key_file is not None)
        if job.k > largest:
            raise ValueError(f"k={job.k}: the leaves' int partial sums of K elements must fit "
                             f"MTU {job.mtu} (the largest k is {largest})")  # fmt: skip
        self.aggregators = self.leaves + 1


@dataclass
class SoakConfig:
    """Everything a soak depends on (recorded in the summary as ``config``).

    minutes: how long to train (the run in progress when time is up finishes); steps_per_run:
    steps of one ``ncina train`` run; restart_s: the range of seconds between two kills (uniform,
    seeded); last_bucket_every: every that many runs, a kill aimed at the run's last step (0:
    none); generations: ``distinct`` (each start a generation other than the last, seeded) or
    ``random`` (the aggregator draws: 1 in 15 repeats); stranger_every: seconds between two
    stranger rounds (0: no stranger); fuzz, hellos, spoofed, forged: datagrams of each kind per
    round; hang_s: a stall of every rank's steps this long is a hang; sample_s: period of the
    memory samples; warmup_s: a process's memory is judged after this long; profile: the job's
    profile (bmv2 only: ``tofino`` runs the Tofino design's twin, ``ncina.proto.profiles``).
    """

    out: Path
    minutes: float = 5.0
    backend: str = "socket"
    workers: int = 4
    loss: float = 2.0
    bw: float | None = 100.0
    seed: int = 0
    steps_per_run: int = 330
    restart_s: tuple[float, float] = (10.0, 40.0)
    last_bucket_every: int = 2
    generations: str = "random"
    stranger_every: float = 5.0
    fuzz: int = 300
    hellos: int = 10
    spoofed: int = 40
    forged: int = 20
    hang_s: float = 60.0
    sample_s: float = 2.0
    warmup_s: float = 10.0
    deadline: float = 30.0
    prefix: str = field(default_factory=lambda: f"k{os.getpid() % 100000}")
    profile: str = DEFAULT


def record(cfg: TopoConfig) -> dict[str, Any]:
    """``cfg`` as results.json records it (``config``): every setting, paths as text, the job
    as ``JobSpec.record`` writes it."""
    return {name: value.record() if isinstance(value, JobSpec)
            else str(value) if isinstance(value, Path) else value
            for name, value in vars(cfg).items()}  # fmt: skip
