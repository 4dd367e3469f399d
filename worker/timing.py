"""The retransmission timeout of the worker: ``RtoEstimator``, measured round-trip times turned
into the timeout a chunk waits for its result before it is re-sent (RFC 6298, with the changes
its docstrings explain). Both data paths share one estimator: the Python loop
(``ncina.worker.transfer``) calls it directly, the C one (``worker/transfer.c``) calls its C
twin ``worker/timing.c``, which mirrors this class operation for operation, with the state
copied in before a call and back after (``ncina.worker.cpath``).
"""

from __future__ import annotations


class RtoEstimator:
    """Retransmission timeout from measured round-trip times, as TCP does it (RFC 6298).

    ``rto`` is the timeout a fresh chunk gets: ``initial`` until the first sample, then
    ``SRTT + max(G, 4 RTTVAR)`` clamped to ``[floor, cap]``. A timed-out chunk's own timeout
    doubles per retransmission up to ``cap`` (``backoff``). Unlike TCP's single timer, a timeout
    does not raise ``rto`` for every fresh chunk: here one slot timing out means a lost packet far
    more often than a slower path, and at 10 % loss such a shared backoff kept the timeouts near
    the cap and made the transfer four times slower. A slower path is still learned: the sampling
    slot keeps its backed-off timeout for its next chunk until one comes back in time (Karn), and
    callers pass only samples that say which copy they time: chunks sent once, and re-sent chunks
    whose result came in order and late enough to answer the first copy (:meth:`spurious`). The
    RTT of a slot includes the queueing behind the rest of the window and the wait for the other
    workers, which is the delay a timeout must wait out.
    """

    ALPHA = 0.125  # SRTT gain (RFC 6298)
    BETA = 0.25  # RTTVAR gain
    GRANULARITY = 0.001  # G: the loop's poll() sleeps in whole milliseconds
    OUTLIER_STREAK = 4  # slow samples in a row taken as a slower path

    def __init__(self, initial: float, cap: float, floor: float) -> None:
        if not 0 < floor <= initial <= cap:
            raise ValueError(
                f"need 0 < min_timeout <= timeout <= max_timeout, got {floor}, {initial}, {cap}"
            )
        self.initial = initial
        self.cap = cap
        self.floor = floor
        self.rto = initial
        self.srtt = 0.0
        self.rttvar = 0.0
        self.samples = 0
        self.outliers = 0
        self.streak = 0  # slow samples skipped in a row

    def sample(self, rtt: float) -> None:
        """Take one RTT measurement (seconds) of a chunk sent once, and recompute ``rto``.

        A sample above twice SRTT is skipped (counted in ``outliers``) unless it is the
        ``OUTLIER_STREAK``-th such sample in a row: in an aggregation the result waits for every
        worker, so a lone slow sample mostly measures another worker's loss recovery, and feeding
        those in raised every worker's RTO, which slowed that recovery further (at 10 % loss both
        ways the RTOs climbed towards the cap). A path that really got slower gives slow samples
        in a row (the sampling slot keeps its backed-off timeout until one comes back).
        """
        if self.samples and rtt > 2 * self.srtt:
            self.streak += 1
            if self.streak < self.OUTLIER_STREAK:
                self.outliers += 1
                return
        self.streak = 0
        if self.samples:
            self.rttvar += self.BETA * (abs(self.srtt - rtt) - self.rttvar)
            self.srtt += self.ALPHA * (rtt - self.srtt)
        else:
            self.srtt, self.rttvar = rtt, rtt / 2
        self.samples += 1
        rto = self.srtt + max(self.GRANULARITY, 4 * self.rttvar)
        self.rto = min(max(rto, self.floor), self.cap)

    def spurious(self, rtt: float, since: float) -> bool:
        """Take a re-sent chunk answered in order (``ncina.worker.transfer.Transfer``), ``rtt``
        after its first send and ``since`` after its last re-send, as a sample when the answer
        came later than a round trip of the re-sent copy would explain: more than ``2 SRTT + G``
        after it. Says whether it was taken.

        In order, the answer is the first copy's when the chunks were queued behind a slow link
        (the re-sent copy waits behind the whole queue), and it then comes at any time up to the
        queue's length after the re-send, mostly well after one round trip of the learnt path.
        A window stalled by loss (at 5-10 % loss with four workers a slot stalls in a third of
        its rounds) also answers its recoveries in order, but each one round trip after its
        re-send: those would be samples of the timeout itself, and taking them raised the RTO
        and slowed the recovery (bench reliability's downlink-loss rows).
        """
        if since <= 2 * self.srtt + self.GRANULARITY:
            return False
        self.sample(rtt)
        return True

    def backoff(self, rto: float) -> float:
        """The timeout after one more retransmission of a chunk whose timeout was ``rto``."""
        return min(2.0 * rto, self.cap)
