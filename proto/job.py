"""A job, defined once: every parameter both sides of a job hold (:class:`JobSpec`), their
defaults and the rules that derive one from the others, their validation, the command-line
options that set them, and their one encoding, the handshake's descriptor
(``ncina.proto.descriptor``, docs/protocol.md "Job handshake").

Every command that takes a job parameter registers it with :meth:`JobSpec.add_arguments` (one
spelling, one default, one help text per option; a command that wants another default names it
there) and reads it back with :meth:`JobSpec.from_args`; a program that starts another command
writes the options with :meth:`JobSpec.to_args`.

What is not here: server mode and its compressor (``ncina aggregator --mode server``: a server's
K is bounded by its compressor's payloads, not by the result format), a job's members and seed
(the aggregator's, ``ncina.aggregator.jobs.JobConfig``). A job's profile (``--profile
tofino``: the Tofino design's limits and window) is a field; its numbers and sentences are
``ncina.proto.profiles``'.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ncina.proto.descriptor import (
    RESULT_NAMES,
    UPLINK_INT,
    UPLINK_MODE,
    WORKERS_WHY,
    Descriptor,
    pack_job_datagram,
    range_problem,
)
from ncina.proto.header import ELEMENT_SIZE, UPLINK_FORMATS, Format, largest_k
from ncina.proto.nc8 import Window
from ncina.proto.profiles import (
    CUT,
    DEFAULT,
    PROFILES,
    TOFINO,
    job_window,
    profile_of,
    tofino_max_k,
    tofino_problems,
)
from ncina.proto.tag import check_key, key_file_argument
from ncina.proto.wire import (
    DEFAULT_MTU,
    MAX_JOB_ID,
    MAX_K,
    MAX_MTU,
    MAX_POOL_SIZE,
    MAX_TOTAL_WORKERS,
    MAX_WORKERS,
    MIN_MTU,
)

DEFAULT_POOL_SIZE = 64
"""Slots in a job's pool when none is given."""
DEFAULT_WINDOW_MAX = 10
"""A job's largest NC8 exponent, e_max, when none is given."""
DEFAULT_RESTART_RETRIES = 3
"""Aggregator restarts one call of a job's workers recovers from when none is given."""
MAX_RESTART_RETRIES = 1000
FORMATS = {"nc8": Format.NC8, "int": Format.INT, "int32": Format.INT32}
"""An INA job's result formats, by their option names."""
UPLINKS = {"nc8": Format.NC8, "int": Format.INT}
"""What an INA job's members may send (``ncina.proto.header.UPLINK_FORMATS``), by name."""
MTU_WHY = " (IPv4's minimum to a jumbo frame)"
TOTAL_WHY = f" (a tree of {MAX_WORKERS} leaves of {MAX_WORKERS}: one aggregator serves at most 64)"


def default_k(
    mtu: int, result_format: Format | str, tagged: bool = False, *, partial_sums: bool = False,
    profile: str = DEFAULT,
) -> int:  # fmt: skip
    """The chunk size a job gets when none is given, the one rule every command and the client
    use: the largest whose datagrams both ways fit one packet of ``mtu``
    (``ncina.proto.header.largest_k``; 1456 for NC8 at MTU 1500), for int lanes where
    ``partial_sums`` travel (a spine's uplink, the workers under a leaf), else for the result
    format; at most the design's lanes under the ``tofino`` profile."""
    if isinstance(result_format, str):
        result_format = FORMATS[result_format]
    lanes = Format.INT if partial_sums else result_format
    k = min(MAX_K, largest_k(mtu, lanes, tagged))
    if profile == TOFINO:  # the design's lanes per pass for its results
        k = min(k, tofino_max_k(result_format))
    return k


def _format(value: Format | str | int) -> Format | str:
    """A format given by name or value as a ``Format``; an unknown one as given (validation
    names it)."""
    if isinstance(value, str):
        return FORMATS.get(value, value)
    try:
        return Format(value)
    except ValueError:
        return str(value)


@dataclass(frozen=True)
class JobSpec:
    """Every parameter of one INA job that the worker and the aggregator must agree on.

    ``k`` None takes the default rule: the largest chunk whose datagrams fit ``mtu`` both ways
    (:func:`default_k`), for int lanes where int partial sums travel (a spine: ``uplink`` int;
    under a leaf: ``total_workers`` above ``workers``), else for the result format; at most
    the design's lanes under the ``tofino`` profile. ``window``
    follows from ``window_max`` (e_max) and the total workers (docs/protocol.md), its top code
    from ``profile`` too (``ncina.proto.profiles.job_window``). Construction
    validates every field and raises one ``ValueError`` naming every violation, one per line.
    """

    job: int
    workers: int
    k: int | None = None
    pool_size: int = DEFAULT_POOL_SIZE
    window_max: int = DEFAULT_WINDOW_MAX
    total_workers: int | None = None
    result: Format = Format.NC8
    uplink: Format = Format.NC8
    key: bytes | None = field(default=None, repr=False)
    mtu: int = DEFAULT_MTU
    profile: str = DEFAULT
    restart_retries: int = DEFAULT_RESTART_RETRIES

    def __post_init__(self) -> None:
        object.__setattr__(self, "result", _format(self.result))
        object.__setattr__(self, "uplink", _format(self.uplink))
        if self.k is None and self._lanes_valid() and MIN_MTU <= self.mtu <= MAX_MTU:
            k = default_k(self.mtu, self.result, self.keyed,
                          partial_sums=self._partial_sums(), profile=self.profile)  # fmt: skip
            object.__setattr__(self, "k", k)
        problems = self.problems()
        if problems:
            raise ValueError("invalid job:\n  " + "\n  ".join(problems))

    # ---- derived values ----

    @property
    def keyed(self) -> bool:
        """Whether the job's datagrams carry an authentication tag."""
        return self.key is not None

    @property
    def total(self) -> int:
        """The workers whose sum the results are: ``total_workers``, else ``workers``."""
        return self.total_workers if self.total_workers is not None else self.workers

    @property
    def window(self) -> Window:
        """The NC8 exponent window of the job (e_max, the total workers and the profile)."""
        return job_window(self.total, self.window_max, self.result, self.profile)

    def _lanes_valid(self) -> bool:
        return self.result in RESULT_NAMES and self.uplink in UPLINK_FORMATS

    def _partial_sums(self) -> bool:
        """Whether int partial sums travel in the job: a spine's uplink, or the workers under a
        leaf."""
        return self.uplink == Format.INT or (
            self.total_workers is not None and self.workers is not None
            and self.total_workers > self.workers
        )  # fmt: skip

    def _lane_format(self) -> Format:
        """The widest element a datagram of the job carries: int where int partial sums travel
        (a spine's uplink, or the workers under a leaf), else the result format's."""
        return Format.INT if self._partial_sums() else Format(self.result)

    # ---- validation ----

    def problems(self) -> list[str]:
        """One message per violated rule, in the order of the fields; empty when valid."""
        mtu = range_problem("--mtu", self.mtu, MIN_MTU, MAX_MTU, MTU_WHY)
        workers = range_problem("workers", self.workers, 1, MAX_WORKERS, WORKERS_WHY)
        out = [
            range_problem("job id", self.job, 0, MAX_JOB_ID),
            workers,
            # k None is left so only where the MTU or a format leaves no default K
            None if self.k is None and (mtu or not self._lanes_valid()) else range_problem(
                "k (elements per packet)", self.k, 1, MAX_K),
            range_problem("pool size", self.pool_size, 1, MAX_POOL_SIZE),
            mtu,
        ]  # fmt: skip
        total = None
        if self.total_workers is not None and workers is None:
            total = range_problem(
                "total workers", self.total_workers, self.workers, MAX_TOTAL_WORKERS,
                f" (at least the {self.workers} workers of this aggregator)")  # fmt: skip
            out.append(total)
            if self.uplink == Format.INT and self.total_workers % self.workers:
                out.append(
                    f"a spine's {self.total_workers} total workers must be a multiple of its "
                    f"{self.workers} leaves (every leaf serves as many workers: their partial "
                    "sums are bounded by it)"
                )
        if workers is None and total is None:
            try:
                self.window  # noqa: B018 (e_max against the total workers)
            except (ValueError, TypeError) as exc:
                out.append(f"no exponent window with e_max {self.window_max}: {exc}")
        for what, value, names in (("result", self.result, FORMATS),
                                   ("uplink", self.uplink, UPLINKS)):  # fmt: skip
            if value not in names.values():
                name = value.name.lower() if isinstance(value, Format) else value
                out.append(f"an INA job's {what} format is one of {', '.join(names)}, not {name}")
        if self.key is not None:
            try:
                check_key(self.key)
            except ValueError as exc:
                out.append(str(exc))
        if not any(out) and self.k > default_k(self.mtu, self._lane_format(), self.keyed):
            out.append(self._frame_problem())
        out.append(range_problem("restart retries", self.restart_retries, 0,
                                 MAX_RESTART_RETRIES))  # fmt: skip
        if self.profile not in PROFILES:
            out.append(f"a job's profile is one of {', '.join(PROFILES)}, not {self.profile}")
        elif self.profile == TOFINO:
            out += tofino_problems(job=self.job, workers=self.workers, k=self.k,
                                   result=self.result, uplink=self.uplink, keyed=self.keyed)
        return [problem for problem in out if problem is not None]

    def _frame_problem(self) -> str:
        lanes = self._lane_format()
        largest = default_k(self.mtu, lanes, self.keyed)
        size = ELEMENT_SIZE[lanes]
        return (
            f"k={self.k} {lanes.name.lower()} elements take {self.k * size} payload bytes, "
            f"more than a datagram has at MTU {self.mtu}; the largest k there is {largest}: "
            "give a smaller --k, or the --mtu that every link of the job carries"
        )

    # ---- the one encoding: the handshake's descriptor ----

    def descriptor(self) -> Descriptor:
        """The job as the handshake carries it (``ncina.proto.descriptor.Descriptor``)."""
        window = self.window
        return Descriptor(
            mode=int(self.result), workers=self.workers, pool_size=self.pool_size, k=self.k,
            e_max=window.e_max, e_min=window.e_min, keyed=self.keyed, compressor=0,
            uplink=UPLINK_INT if self.uplink == Format.INT else UPLINK_MODE,
        )  # fmt: skip

    def hello(self, rank: int) -> bytes:
        """The ``job`` datagram a worker of ``rank`` sends before its first chunk."""
        return pack_job_datagram(self.descriptor(), job=self.job, rank=rank, key=self.key)

    @classmethod
    def from_descriptor(
        cls, job: int, descriptor: Descriptor, *, key: bytes | None = None, mtu: int = DEFAULT_MTU
    ) -> JobSpec:
        """The job a descriptor describes. The wire carries whether the job is keyed, not its
        key, nor the MTU: give them. It carries the window, not the total workers: a window
        other than ``workers``' own decodes to the fewest total workers that have it (a spine's:
        a multiple of its leaves), which give the same descriptor; nor the profile, which its
        window tells (``ncina.proto.profiles.profile_of``). Raises ``ValueError`` for a
        server-mode descriptor or a key that does not match ``keyed``."""
        if descriptor.mode not in RESULT_NAMES:
            raise ValueError(f"descriptor mode {descriptor.mode} is not an INA job's")
        if descriptor.keyed != (key is not None):
            raise ValueError("the descriptor's job is keyed: give its key" if descriptor.keyed
                             else "the descriptor's job has no key")  # fmt: skip
        window = Window(e_min=descriptor.e_min, span=descriptor.e_max - descriptor.e_min)
        profile = profile_of(descriptor.mode, window.span)
        if profile == TOFINO:  # the floor of the window whose codes a tofino job caps
            window = Window(e_min=window.e_min, span=window.span + CUT)
        total = None
        if Window.for_job(descriptor.workers, window.e_max) != window:
            # span = 62 - ceil(log2(total)): the fewest such totals is 2**(62 - span - 1) + 1,
            # for a spine the fewest multiple of its leaves from there.
            total = max(descriptor.workers, (1 << (62 - window.span - 1)) + 1)
            if descriptor.uplink == UPLINK_INT:
                total = -(-total // descriptor.workers) * descriptor.workers
        return cls(
            job=job, workers=descriptor.workers, k=descriptor.k, pool_size=descriptor.pool_size,
            window_max=window.e_max, total_workers=total, result=Format(descriptor.mode),
            uplink=Format.INT if descriptor.uplink == UPLINK_INT else Format.NC8, key=key,
            mtu=mtu, profile=profile,
        )  # fmt: skip

    # ---- the command line ----

    @classmethod
    def add_arguments(
        cls,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        *names: str,
        required: Iterable[str] = (),
        rules: Mapping[str, str] | None = None,
        role: str | None = None,
        lacks: Iterable[str] = (),
        **defaults: Any,
    ) -> dict[str, argparse.Action]:
        """Register the options of the fields ``names`` (all when none is named) on ``parser``
        and return their actions by field name. ``required`` names the fields a command must be
        given; ``defaults`` gives a command's own default for a field (``k=256``); ``rules``
        says in the help what a default of None means where it is not the field's rule.

        ``role`` instead of ``names`` (``ROLE_LACKS``: ``aggregator``, ``worker`` or ``run``)
        registers every field of the role that ``parser`` has no option for yet, but those the
        command ``lacks`` (it derives them): a command names fields only to place them or to
        give them a default of its own, and ends with its role's call, through which a new
        field becomes an option of every command of its role."""
        if role is not None:
            if names:
                raise ValueError("give the fields by name or by role, not both")
            taken = parser._option_string_actions  # a group shares its parser's
            names = tuple(name for name in role_fields(role)
                          if name not in set(lacks) and OPTIONS[name].flag not in taken)
            given = set(required) | set(defaults) | set(rules or {})
            if given - set(names):
                raise ValueError("not a field left to the role: "
                                 + ", ".join(sorted(given - set(names))))
            if not names:
                return {}
        unknown = (set(names) | set(required) | set(defaults) | set(rules or {})) - OPTIONS.keys()
        if unknown:
            raise ValueError(f"not a job option: {', '.join(sorted(unknown))}")
        actions = {}
        for name in names or OPTIONS:
            option = OPTIONS[name]
            default = defaults.get(name, option.default)
            rule = (rules or {}).get(name, option.rule)
            help_text = option.help
            if name in required:
                pass
            elif default is not None:
                help_text += " (default: %(default)s)"
            elif rule:
                help_text += f" (default: {rule})"
            actions[name] = parser.add_argument(
                option.flag, dest=option.dest, default=None if name in required else default,
                required=name in required, help=help_text, **option.kwargs,
            )  # fmt: skip
        return actions

    @classmethod
    def from_args(cls, namespace: argparse.Namespace, **overrides: Any) -> JobSpec:
        """The job of parsed options (those of :meth:`add_arguments`); ``overrides`` replaces
        fields (a value the command derived itself). An option that is absent or None takes the
        field's default."""
        values = {}
        for name, option in OPTIONS.items():
            value = overrides.get(name, getattr(namespace, option.dest, None))
            if value is not None:
                values[name] = value
        for name in ("job", "workers"):
            values.setdefault(name, None)
        return cls(**values)

    def to_args(self, *names: str, role: str | None = None, lacks: Iterable[str] = ()) -> list[str]:
        """The options that give another command this job's fields ``names`` (all but ``key``,
        which travels as a file, when none is named; with ``role``, every field of that role
        but those the command ``lacks`` and the key: ``add_arguments``'); a field that is None
        is left out."""
        if role is not None:
            names = tuple(n for n in role_fields(role) if n not in (*lacks, "key"))
        return job_args(**{name: getattr(self, name)
                           for name in names or [n for n in OPTIONS if n != "key"]})  # fmt: skip

    def record(self) -> dict[str, Any]:
        """The job's fields by name as JSON holds them (a run's record): formats by their
        option names, the key left out (a secret); ``JobSpec(**record)`` is the job again,
        unkeyed."""
        return {f.name: value.name.lower() if isinstance(value, Format) else value
                for f in fields(self) if f.name != "key"
                for value in [getattr(self, f.name)]}  # fmt: skip


def job_args(**values: Any) -> list[str]:
    """Command-line options for job fields given by name (``job_args(k=256, workers=4)``),
    spelled as ``OPTIONS`` spells them, unvalidated (a test may pass a bad value on purpose); a
    value of None is left out."""
    out = []
    for name, value in values.items():
        if name == "key" and value is not None:
            raise ValueError("a key travels in a file: give the command --key-file FILE")
        if value is not None:
            out += [OPTIONS[name].flag,
                    value.name.lower() if isinstance(value, Format) else str(value)]
    return out


class Ranged:
    """argparse type of a job's integer option: a number no job can have (outside
    ``low..high``) is refused when parsed, with the message of :class:`JobSpec`'s validation;
    what depends on other options (workers of one aggregator, K against the MTU) is checked
    with them."""

    def __init__(self, what: str, low: int, high: int, why: str = "") -> None:
        self.what, self.low, self.high, self.why = what, low, high, why

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        problem = range_problem(self.what, value, self.low, self.high, self.why)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


@dataclass(frozen=True)
class Option:
    """A job field's command-line option: its spelling, what it is, its default and, where that
    is None, the rule that decides it."""

    flag: str
    dest: str
    help: str
    default: Any = None
    rule: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def parse(self, text: str) -> Any:
        """The option's value of ``text``, as the command line parses it (its ``type`` and
        ``choices``): for a value given elsewhere, an environment variable. ``ValueError``
        says what is wrong."""
        try:
            value = self.kwargs.get("type", str)(text)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        choices = self.kwargs.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{self.flag} is one of {', '.join(choices)}, not {text}")
        return value


OPTIONS: dict[str, Option] = {
    "job": Option("--job", "job", f"job id (0..{MAX_JOB_ID})",
                  kwargs={"type": Ranged("job id", 0, MAX_JOB_ID)}),
    "workers": Option(
        "--workers", "workers", "workers in the job, ranks 0..N-1",
        kwargs={"type": Ranged("workers", 1, MAX_TOTAL_WORKERS, TOTAL_WHY), "metavar": "N"}),
    "k": Option(
        "--k", "k", f"elements per packet, the job's K (1..{MAX_K})",
        rule="the most whose datagrams fit --mtu both ways: 1456 nc8 elements at 1500, 8956 at "
        "9000, 182 int ones at 1500; int lanes where int partial sums travel (a spine, or "
        "under a leaf)", kwargs={"type": Ranged("k (elements per packet)", 1, MAX_K)}),
    "pool_size": Option(
        "--pool-size", "pool_size", f"slots in the job's pool (1..{MAX_POOL_SIZE})",
        DEFAULT_POOL_SIZE,
        kwargs={"type": Ranged("pool size", 1, MAX_POOL_SIZE), "metavar": "S"}),
    "window_max": Option(
        "--window-max", "window_max", "largest exponent of the NC8 window, e_max; e_min "
        "follows from it and the (total) workers", DEFAULT_WINDOW_MAX,
        kwargs={"type": int, "metavar": "E"}),
    "total_workers": Option(
        "--total-workers", "total_workers", "hierarchical aggregation (docs/protocol.md): the "
        "workers of the whole tree, whose window every aggregator and worker of the job uses "
        "and whose sum the results are (a leaf: its --workers times the leaves)",
        rule="--workers",
        kwargs={"type": Ranged("total workers", 1, MAX_TOTAL_WORKERS, TOTAL_WHY), "metavar": "N"}),
    "result": Option(
        "--result", "result", "the results' payload: nc8 (sums re-compressed to NC8, 1 byte per "
        "element), int (exact sums, 8 bytes per element) or int32 (exact sums, 4 bytes per "
        "element, in a window whose sums stay within 2^30: docs/protocol.md)", "nc8",
        kwargs={"choices": tuple(FORMATS)}),
    "uplink": Option(
        "--uplink", "uplink", "what the members send: nc8 codes (workers) or int, the exact "
        "partial sums of leaf aggregators: a spine, whose --workers are its leaves", "nc8",
        kwargs={"choices": tuple(UPLINKS)}),
    "key": Option(
        "--key-file", "key_file", "the job's shared secret, 16-64 bytes as hex in FILE: every "
        "datagram of the job then carries an authentication tag, and results carry one "
        "(docs/protocol.md, 'Authentication tag')",
        kwargs={"type": key_file_argument, "metavar": "FILE"}),
    "mtu": Option(
        "--mtu", "mtu", f"IP MTU of the links ({MIN_MTU}..{MAX_MTU}): every datagram of the "
        "job must fit it, and the default --k follows from it", DEFAULT_MTU,
        kwargs={"type": Ranged("--mtu", MIN_MTU, MAX_MTU, MTU_WHY)}),
    "profile": Option(
        "--profile", "profile", "the switch design the job's arithmetic and limits follow on "
        "every backend: default (docs/protocol.md) or tofino (the Tofino program's: 32-bit "
        "lanes, codes up to 31 - ceil(log2 N) above the window's e_min, K <= 12, 30 workers, "
        "int32, int or nc8 results, no key: docs/tofino.md)", DEFAULT,
        kwargs={"choices": PROFILES}),
    "restart_retries": Option(
        "--restart-retries", "restart_retries", "aggregator restarts one all-reduce of the job "
        "recovers from, with every other rank (docs/reliability.md): every worker of the job "
        "takes the same; one more fails the call", DEFAULT_RESTART_RETRIES,
        kwargs={"type": Ranged("restart retries", 0, MAX_RESTART_RETRIES), "metavar": "N"}),
}  # fmt: skip
"""Every job field's option, by field name: the one place an option is spelled."""


ROLE_LACKS: dict[str, tuple[str, ...]] = {
    "aggregator": ("restart_retries",),
    "worker": ("uplink",),
    "run": ("job", "total_workers", "uplink", "key"),
}
"""The job fields each role of command does not offer (``JobSpec.add_arguments(parser,
role=...)``); it offers every other, a new field included. ``aggregator``: ``ncina aggregator``,
every field but the workers' recovery (``restart_retries``). ``worker``: ``ncina allreduce``
and ``ncina train``; a worker sends NC8 codes, only a leaf aggregator sends int uplinks.
``run``: a command that runs a whole job, its aggregators and workers (``ncina topo``, ``ncina
bench allreduce|fabric|ddp``): the run picks its one job's id and its tree's shape, and a key
travels as a file (``ncina topo --key-file``, its own option)."""


def role_fields(role: str) -> tuple[str, ...]:
    """The job fields a command of ``role`` offers (``ROLE_LACKS``), in ``OPTIONS``' order."""
    if role not in ROLE_LACKS:
        raise ValueError(f"a command's role is one of {', '.join(ROLE_LACKS)}, not {role}")
    return tuple(name for name in OPTIONS if name not in ROLE_LACKS[role])
