"""The P4Runtime control plane (p4runtime-shell): push the pipeline, install ``entries``, read
counters, take the switch's digests (a thread of its own may, while another reads counters:
every call holds the controller's lock). Registers are not readable over BMv2's P4Runtime
server: read them with ``simple_switch_CLI --thrift-port PORT`` for debugging (docs/bmv2.md).

p4runtime-shell keeps one global session and calls ``sys.exit`` when ``setup`` fails; here every
failure becomes a ``Bmv2Error`` naming the switch, so the caller decides what to do.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ncina.aggregator.backends.bmv2.entries import Counts, Entry, Group
from ncina.aggregator.backends.bmv2.toolchain import Build


class Bmv2Error(RuntimeError):
    """A P4Runtime operation on the switch failed; the message names the switch and the step."""


class _ShellRecords(logging.Filter):
    """Drops the records p4runtime-shell logs on the root logger (it logs every RPC error
    there, and each failure reaches the caller as a ``Bmv2Error`` anyway); every other record
    passes, and with the root logger at DEBUG (``ncina --debug``) so do the shell's."""

    def __init__(self, package_dir: str) -> None:
        super().__init__()
        self.package_dir = package_dir

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(self.package_dir) or (
            logging.getLogger().isEnabledFor(logging.DEBUG)
        )


def _shell() -> Any:
    try:
        import p4runtime_sh
        import p4runtime_sh.shell as sh
    except ImportError as exc:  # an optional dependency (pip install p4runtime-shell)
        raise Bmv2Error(
            f"p4runtime-shell is not installed ({exc}): pip install p4runtime-shell"
        ) from None
    root = logging.getLogger()
    if not any(isinstance(f, _ShellRecords) for f in root.filters):
        root.addFilter(_ShellRecords(str(Path(p4runtime_sh.__file__).parent)))
    return sh


@contextlib.contextmanager
def _step(address: str, what: str) -> Iterator[None]:
    """Turn every failure of a p4runtime-shell call, ``SystemExit`` included, into Bmv2Error."""
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            yield
    except (Exception, SystemExit) as exc:
        detail = str(exc).strip() if not isinstance(exc, SystemExit) else "p4runtime-shell gave up"
        logged = output.getvalue().strip()
        raise Bmv2Error(
            f"P4Runtime at {address}: {what} failed: {detail}" + (f" ({logged})" if logged else "")
        ) from None


class Controller:
    """One P4Runtime session with a switch (p4runtime-shell allows one per process)."""

    def __init__(self, address: str, device_id: int = 1, election_id: tuple[int, int] = (0, 1)):
        self.address = address
        self.device_id = device_id
        self.election_id = election_id
        self._sh: Any = None
        self._lock = threading.Lock()  # the shell's session, and _step's stdout, are global

    def connect(self, build: Build) -> Controller:
        """Become primary controller and push ``build``'s pipeline (P4Info + BMv2 JSON)."""
        sh = _shell()
        try:
            with _step(self.address, f"connecting to device {self.device_id} and pushing "
                       f"{build.json}"):  # fmt: skip
                sh.setup(
                    device_id=self.device_id,
                    grpc_addr=self.address,
                    election_id=self.election_id,
                    config=sh.FwdPipeConfig(str(build.p4info), str(build.json)),
                    verbose=False,
                )
        except Bmv2Error:
            # A half-made session keeps a stream thread waiting: end it, or the process hangs.
            if getattr(sh, "client", None) is not None:
                with contextlib.suppress(Exception):
                    sh.client.tear_down()
                sh.client = None
            raise
        self._sh = sh
        return self

    def _table_entry(self, entry: Entry) -> Any:
        te = self._session().TableEntry(entry.table)(action=entry.action)
        for name, value in entry.match.items():
            te.match[name] = value
        for name, value in entry.params.items():
            te.action[name] = value
        return te

    def insert(self, entry: Entry) -> None:
        with self._lock, _step(self.address, f"inserting into {entry.table} {dict(entry.match)}"):
            self._table_entry(entry).insert()

    def insert_all(self, entries: Sequence[Entry]) -> None:
        """Insert ``entries`` in one P4Runtime write (the lanes' thousands of table entries:
        one write each took seconds)."""
        self._write(entries, "INSERT")

    def delete_all(self, entries: Sequence[Entry]) -> None:
        """Delete ``entries`` in one P4Runtime write, in their order."""
        self._write(entries, "DELETE")

    def _write(self, entries: Sequence[Entry], kind: str) -> None:
        from p4.v1 import p4runtime_pb2

        sh = self._session()
        with self._lock, _step(self.address, f"{kind.lower()} of {len(entries)} entries"):
            request = p4runtime_pb2.WriteRequest()
            for entry in entries:
                update = request.updates.add()
                update.type = p4runtime_pb2.Update.Type.Value(kind)
                update.entity.table_entry.CopyFrom(self._table_entry(entry).msg())
            sh.client.write(request)

    def insert_group(self, group: Group) -> None:
        sh = self._session()
        with self._lock, _step(self.address, f"creating multicast group {group.group}"):
            mg = sh.MulticastGroupEntry(group.group)
            for port, instance in group.replicas:
                mg.add(port, instance)
            mg.insert()

    def read_counters(self, names: Sequence[str]) -> dict[str, Counts]:
        """Every index of each counter of ``names`` (name -> index -> (packets, bytes)), in one
        P4Runtime read: the switch answers them one after the other in one request, where a
        read per counter let packets arrive between two round trips (tens of ms under load), so
        one document could hold a packet's event and not its ``packets_in`` (issue 37: the
        twin's fuzz test saw three datagrams neither dropped nor answered)."""
        from p4.v1 import p4runtime_pb2

        sh = self._session()
        ids = {sh.CounterEntry(name).id: name for name in names}
        counts: dict[str, dict[int, tuple[int, int]]] = {name: {} for name in names}
        with self._lock, _step(self.address, f"reading counters {', '.join(names)}"):
            request = p4runtime_pb2.ReadRequest(device_id=sh.client.device_id)
            for counter_id in ids:
                request.entities.add().counter_entry.counter_id = counter_id
            for response in sh.client.stub.Read(request):
                for entity in response.entities:
                    entry = entity.counter_entry
                    counts[ids[entry.counter_id]][entry.index.index] = (
                        entry.data.packet_count, entry.data.byte_count)
        return counts

    def subscribe(self, digest: str) -> None:
        """Have the switch send the digest ``digest`` (its P4Info name) at once, one per list
        (``DigestEntry``: no batching, no waiting); until a list is acknowledged, the switch
        holds back the same data (for at most a second)."""
        sh = self._session()
        with self._lock, _step(self.address, f"subscribing to digest {digest}"):
            entry = sh.DigestEntry(digest)
            entry.max_timeout_ns = 0
            entry.max_list_size = 1
            entry.ack_timeout_ns = 1_000_000_000
            entry.insert()

    def digest_list(self, timeout: float) -> Any:
        """The next ``DigestList`` from the stream channel (p4.v1's message), or None within
        ``timeout`` seconds (or once the session is closed)."""
        message = self._session().client.get_stream_packet("digest", timeout=timeout)
        return None if message is None else message.digest

    def acknowledge(self, digests: Any) -> None:
        """Acknowledge a ``DigestList`` (``DigestListAck`` on the stream channel)."""
        from p4.v1 import p4runtime_pb2

        ack = p4runtime_pb2.StreamMessageRequest()
        ack.digest_ack.digest_id = digests.digest_id
        ack.digest_ack.list_id = digests.list_id
        self._session().client.stream_out_q.put(ack)

    def close(self) -> None:
        if self._sh is not None:
            with contextlib.suppress(Exception):
                self._sh.teardown()
            self._sh = None

    def _session(self) -> Any:
        if self._sh is None:
            raise Bmv2Error(f"P4Runtime at {self.address}: not connected")
        return self._sh

