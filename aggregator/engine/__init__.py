"""The C slot engine (``aggregator/engine``) that the socket and dpdk backends share.

The engine is the protocol of docs/protocol.md on UDP datagrams, one file per concept with the
names of the Python reference (``ncina.aggregator``) and of p4/ (docs/architecture.md): header
parse, admission, members, the slot state machine, replies, the handshake, and the pipeline that
runs them in the order of checks (``parse.c``, ``admission.c``, ``members.c``, ``slots.c``,
``reply.c``, ``handshake.c``, ``pipeline.c``). Each I/O layer compiles it into its own cffi
extension, next to its own loop; :class:`Engine` is the control plane both drivers use on that
extension: jobs (and the seed of their nc8 results, and what their members send: a spine's take
int partial sums), members, keys and the counters as ``ncina.aggregator.stats`` objects.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from ncina.aggregator.hierarchy import (
    UPSTREAM_COUNTERS,
    UPSTREAM_DROP_REASONS,
    LeafAggregator,
    UpstreamStats,
)
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.stats import (
    GLOBAL_DROP_REASONS,
    JOB_COUNTERS,
    JOB_DROP_REASONS,
    GlobalStats,
    JobStats,
)

HERE = Path(__file__).resolve().parent
PROTO = HERE.parent.parent / "proto"
SOURCES = (
    "parse.c", "members.c", "slots.c", "reply.c", "admission.c", "handshake.c", "upstream.c",
    "pipeline.c",
)  # fmt: skip
HEADERS = ("engine.h", "datapath.h", "state.h")
# The wire codecs of ncina.proto the engine links in: NC8 and the tag's BLAKE2b.
PROTO_SOURCES = ("nc8.c", "blake2b.c")
PROTO_HEADERS = ("nc8.h", "blake2b.h")
COMPILE_ARGS = ("-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter")
# The order of enum nce_drop in engine.h.
DROP_NAMES = (
    "truncated",
    "bad_version",
    "bad_flags",
    "bad_format",
    "window_mismatch",
    "unknown_job",
    "non_member",
    "bad_slot",
    "bad_count",
    "bad_length",
    "bad_code",
    "chunk_mismatch",
    "bad_tag",
    "stale_generation",
    "late",
    "resend_limit",
)


def proto_dir() -> Path:
    """The folder of the proto C sources (the repository's proto/, or the installed package)."""
    if (PROTO / "nc8.c").is_file():
        return PROTO
    import ncina.proto

    return Path(ncina.proto.__file__).resolve().parent


def cdef_of(header: Path) -> str:
    """The declarations of a C header that cffi parses (everything but preprocessor lines)."""
    lines = header.read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def build(
    name: str,
    io_dir: Path,
    io_sources: tuple[str, ...],
    io_header: str,
    io_private: tuple[str, ...] = (),
    pkg_config: str | None = None,
) -> ModuleType:
    """Build (cached, ``ncina.common.cbuild``) an I/O layer's extension: its sources in ``io_dir``,
    the engine and the proto codecs; the cdef is ``engine.h`` then ``io_header``."""
    from ncina.common.cbuild import build_extension

    proto = proto_dir()
    return build_extension(
        name,
        cdef_of(HERE / "engine.h") + "\n" + cdef_of(io_dir / io_header),
        [
            *(io_dir / s for s in io_sources),
            *(HERE / s for s in SOURCES),
            *(proto / s for s in PROTO_SOURCES),
        ],
        preamble=f'#include "engine.h"\n#include "{io_header}"\n',
        extra_compile_args=COMPILE_ARGS,
        include_dirs=[io_dir, HERE, proto],
        depends=[
            *(io_dir / h for h in (io_header, *io_private)),
            *(HERE / h for h in HEADERS),
            *(proto / h for h in PROTO_HEADERS),
        ],
        pkg_config=pkg_config,
    )


class Engine:
    """The control plane of the engine inside one extension module (one engine per module)."""

    def __init__(self, module: ModuleType) -> None:
        self.ffi = module.ffi
        self.lib = module.lib

    def check(self, rc: int, what: str) -> None:
        """Raise ``RuntimeError`` naming ``what`` and the engine's reason unless ``rc`` is 0."""
        if rc != 0:
            reason = self.ffi.string(self.lib.nce_error()).decode(errors="replace")
            raise RuntimeError(f"{what}: {reason}")

    def set_reply_room(self, room: int, limit: str) -> None:
        """The largest reply datagram the I/O layer can send, and what that limit is (for the
        engine's message when it refuses a job whose results exceed it)."""
        self.lib.nce_set_reply_room(room, limit.encode())

    def set_generation(self, generation: int) -> None:
        """The generation stamped on every result and notice (0: none, no notices)."""
        self.lib.nce_set_generation(generation)

    def set_restart_idle(self, seconds: float) -> None:
        """How long a job must have been quiet before an authentic hello restarts it
        (``ncina.aggregator.backends.python.handshake.RESTART_IDLE``, ``--restart-idle``)."""
        self.lib.nce_set_restart_idle(round(seconds * 1e9))

    def set_resend_interval(self, seconds: float) -> None:
        """How long after the last result sent again to a member for a slot version, once its
        round's burst is spent, rule 2 may send it again (``slots.RESEND_INTERVAL``)."""
        self.lib.nce_set_resend_interval(round(seconds * 1e9))

    def add_job(self, config: JobConfig) -> None:
        """Install a job (with ``config.result_seed()``: its nc8 results are the reference's
        under the same seed, whatever the order of completions) and its members. A job that
        cannot be installed (``RuntimeError``) leaves nothing behind."""
        import ipaddress

        window = config.window
        self.check(
            self.lib.nce_job_add(
                config.job,
                config.workers,
                config.k,
                config.pool_size,
                window.e_min,
                window.span,
                int(config.result_format),
                config.result_seed(),
            ),
            f"installing job {config.job}",
        )
        if config.key is not None:  # a refused key removes the job in the engine
            self.check(self.lib.nce_job_set_key(config.job, config.key, len(config.key)),
                       f"job {config.job} key")  # fmt: skip
        try:
            # A spine's members are leaves sending int partial sums (docs/protocol.md,
            # "Hierarchical aggregation"); the window above is the one of the total workers.
            self.check(
                self.lib.nce_job_set_uplink(
                    config.job, int(config.uplink_format), config.total
                ),
                f"job {config.job} uplink",
            )
            for rank, (host, port) in sorted(config.members.items()):
                self.check(
                    self.lib.nce_member_set(
                        config.job, rank, ipaddress.IPv4Address(host).packed, port
                    ),
                    f"job {config.job} member {rank}",
                )
            self.check(self.lib.nce_job_publish(config.job), f"publishing job {config.job}")
        except RuntimeError:
            self.lib.nce_job_remove(config.job)
            raise

    def set_upstream(self, job: int, leaf: LeafAggregator) -> None:
        """Make ``job`` the leaf of ``leaf``'s spine (``ncina.aggregator.hierarchy``): its
        address, the leaf's rank and the spine's generation (after ``leaf.join``) and the leaf's
        hello, which the engine sends again when a worker's hello restarts the job."""
        import ipaddress

        up = leaf.upstream
        host, port = up.address
        hello = leaf.hello_datagram()
        self.check(
            self.lib.nce_job_set_upstream(job, ipaddress.IPv4Address(host).packed, port,
                                          up.rank, up.generation, hello, len(hello)),
            f"job {job} upstream",
        )  # fmt: skip

    def upstream_stats(self) -> UpstreamStats:
        """The engine's counters of the leaf's traffic with its spine (``UpstreamStats``)."""
        c = self.ffi.new("struct nce_upstream_counters *")
        self.lib.nce_upstream_stats(c)
        stats = UpstreamStats()
        _copy_counters(c, stats, UPSTREAM_COUNTERS, UPSTREAM_DROP_REASONS)
        return stats

    def remove_job(self, job: int) -> None:
        """Uninstall a job (its slots and counters go with it); safe while the data plane runs
        (``set_live``): returns once no batch of the data plane can hold the job any more."""
        self.check(self.lib.nce_job_remove(job), f"removing job {job}")

    def set_live(self, live: bool) -> None:
        """Say whether a data plane runs: while it does, ``add_job`` configures a job completely
        before the data plane sees it."""
        self.lib.nce_set_live(int(live))

    def _counters(self, job: int) -> Any:
        c = self.ffi.new("struct nce_counters *")
        self.check(self.lib.nce_job_stats(job, c), f"job {job} stats")
        return c

    def job_stats(self, job: int) -> JobStats:
        """The job's counters as the reference's ``JobStats``."""
        c = self._counters(job)
        stats = JobStats()
        others = _copy_counters(c, stats, JOB_COUNTERS, JOB_DROP_REASONS)
        if others:  # never happens: the engine counts these globally
            raise RuntimeError(f"job {job} counted {others[0]}, a global reason")
        return stats

    def global_stats(self) -> GlobalStats:
        """The engine's global section (``GlobalStats``; the I/O layer adds ``send_errors``)."""
        c = self.ffi.new("struct nce_counters *")
        self.lib.nce_global_stats(c)
        stats = GlobalStats()
        _copy_counters(c, stats, ("packets_in", "bytes_in"), GLOBAL_DROP_REASONS)
        return stats


def _copy_counters(
    c: Any, stats: Any, counters: Iterable[str], reasons: Container[str]
) -> list[str]:
    """The engine's counters ``c`` into ``stats``: the fields ``counters``, and the drops of the
    reasons in ``reasons``; returns the other reasons ``c`` counted drops for."""
    for name in counters:
        setattr(stats, name, getattr(c, name))
    others = []
    for i, name in enumerate(DROP_NAMES):
        if name in reasons:
            stats.drops[name] = c.drops[i]
        elif c.drops[i]:
            others.append(name)
    return others
