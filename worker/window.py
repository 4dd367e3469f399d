"""How many slots of the pool a worker keeps in flight: ``CongestionWindow``, a delay-based
congestion window (docs/reliability.md, "The congestion window"). Both data paths share one
window per client, like the RTO estimator (``ncina.worker.timing``): the Python loop
(``ncina.worker.transfer``) calls it directly, the C one (``worker/transfer.c``) calls its C twin
``worker/window.c``, which mirrors this class operation for operation, with the state copied in
before a call and back after (``ncina.worker.cpath``).

The window only limits how many slots have a chunk outstanding: chunk ``i`` still goes into slot
``i % S``, and a slot is reused only after its result arrived (SwitchML's slot semantics); chunks
start in order, each when the window has room and its slot is free.
"""

from __future__ import annotations

WINDOW_MODES = ("fixed", "adaptive")  # the default first (docs/reliability.md: why)
WINDOW_ENV = "NCINA_CWND"  # the mode when the client is given none


class CongestionWindow:
    """A congestion window in slots, grown and shrunk from the round trips measured.

    ``limit`` is the number of slots that may have a chunk outstanding: ``cwnd`` rounded down,
    at least 1 and at most the pool (``fixed``: always the pool, and none of the rules below).

    - **Delay** (after Swift, Kumar et al., SIGCOMM 2020, with TCP Vegas's base RTT): every result
      of a chunk sent once gives an RTT; ``base`` is the smallest seen. Once per round (a window
      of results: as many as ``limit`` when the round began) the smallest RTT of the round less
      ``base`` is the standing queue this worker's window (and the others') keeps on the path,
      ``delay``: the smallest, because a descheduled process (four workers and the aggregator on
      two cores) delays some results of a round, a queue all of them. At or above ``TARGET``,
      ``cwnd`` is multiplied by ``1 - BETA (delay - TARGET) / delay``, at least ``1 -
      MAX_DECREASE`` (the window that would leave ``TARGET`` of queue at the rate measured,
      roughly); below, it grows by ``GAIN`` slots. It settles where the bottleneck holds about
      ``TARGET`` seconds of queue, whatever its bandwidth: enough to keep the link busy across a
      descheduled worker, and well under the 20 ms floor of the RTO, which a window that queues
      longer than the RTO learnt on the idle path turns into copies on the wire.
    - **Slow start**: from ``INITIAL`` slots, one more per result (doubling per round trip)
      until a round's delay reaches ``TARGET``; the first round of a call on a slow link then
      queues ``INITIAL`` chunks, not the pool.
    - **No halving on a timeout**: on these fabrics nothing is lost for congestion (a queue
      holds far more than a pool), so a timeout while a queue stands is a copy sent too early
      (the RTO below the queue, the machine's scheduling) or random loss, and the delay rule
      already answers the queue; a first version that halved the window on such timeouts left
      the DDP benchmark's windows at a third of the pool (docs/reliability.md).
    - **Stall** (``stall``): no result for a whole RTO, as when the other workers have not sent
      their chunks yet (a DDP bucket that one rank reaches late) or the path lost everything:
      ``cwnd`` drops to 1 and slow start begins again (TCP's response to a timeout; the queue,
      if any, has drained), and the transfer re-sends one chunk rather than the whole window;
      the window before is kept, and the first result of a chunk sent once before the stall
      puts it back (``resume``: its first copy was answered, nothing was lost, the window
      waited). Such chunks give no RTT: their round trips include the wait.

    The rules are fed by the transfers, so that both data paths make the same decisions:
    ``sample`` per result (with its RTT when its chunk was sent once, after the last stall),
    ``resume`` per result of a chunk sent once before it, ``stall`` per timer check with no
    result for an RTO.
    """

    TARGET = 0.005  # standing queueing delay aimed at (s): a quarter of the RTO's default floor
    BETA = 0.8  # share of the excess delay a decrease takes off (Swift's beta)
    MAX_DECREASE = 0.5  # the most one round takes off
    GAIN = 1.0  # slots added per round below the target
    INITIAL = 8  # slots in flight before the first round trip

    def __init__(self, pool: int, mode: str = "adaptive") -> None:
        if pool < 1:
            raise ValueError(f"the pool must hold at least one slot, got {pool}")
        if mode not in WINDOW_MODES:
            raise ValueError(f"the window mode must be one of {WINDOW_MODES}, got {mode!r}")
        self.pool = pool
        self.adaptive = mode == "adaptive"
        self.cwnd = float(min(pool, self.INITIAL) if self.adaptive else pool)
        self.base = 0.0  # smallest RTT seen (s), 0: none yet
        self.delay = 0.0  # the last round's standing queueing delay (s)
        self.round_min = 0.0  # smallest RTT of the round so far, 0: none yet
        self.round_results = 0  # results of the round so far
        self.round_size = self.limit  # results that end it: the window when it began
        self.slow_start = True
        self.saved = 0.0  # cwnd before a stall, 0: no stall pending
        self.saved_slow_start = True  # and whether it was in slow start
        self.stalls = 0  # timer checks that found no result for an RTO

    @property
    def limit(self) -> int:
        """Slots that may have a chunk outstanding (1..pool)."""
        return min(self.pool, max(1, int(self.cwnd)))

    def sample(self, rtt: float) -> None:
        """A result came back: of a chunk sent once ``rtt`` seconds before, or (``rtt``
        negative: no measurement) of a re-sent chunk (Karn's rule) or of one sent before a
        stall (its round trip includes the wait), which counts in the round and grows a slow
        start all the same, or a window that lost everything would stay at one."""
        if not self.adaptive:
            return
        if rtt >= 0.0:
            if self.base == 0.0 or rtt < self.base:
                self.base = rtt
            if self.round_min == 0.0 or rtt < self.round_min:
                self.round_min = rtt
        self.round_results += 1
        if self.slow_start:
            self.cwnd += 1.0
        self.cwnd = min(float(self.pool), max(1.0, self.cwnd))
        if self.round_results >= self.round_size:
            self.end_round()

    def end_round(self) -> None:
        """A window of results is in: measure the standing delay, move the window, begin the
        next round."""
        if self.round_min > 0.0:
            self.delay = self.round_min - self.base
        if self.delay >= self.TARGET:
            self.slow_start = False
            excess = self.BETA * (self.delay - self.TARGET) / self.delay
            self.cwnd = max(1.0, self.cwnd * (1.0 - min(excess, self.MAX_DECREASE)))
        elif not self.slow_start:
            self.cwnd = min(float(self.pool), self.cwnd + self.GAIN)
        self.round_min = 0.0
        self.round_results = 0
        self.round_size = self.limit

    def resume(self) -> None:
        """A chunk sent once before a stall was answered: its first copy arrived, nothing was
        lost, the window only waited; the window before the stall comes back, and a new
        round begins."""
        if not self.adaptive or self.saved == 0.0:
            return
        self.cwnd = max(self.cwnd, self.saved)
        self.slow_start = self.saved_slow_start
        self.saved = 0.0
        self.round_min = 0.0
        self.round_results = 0
        self.round_size = self.limit

    def stall(self) -> bool:
        """A timer check found no result for an RTO. Says whether the transfer holds back the
        chunks it has not re-sent yet (all but one: adaptive only)."""
        if not self.adaptive:
            return False
        if self.saved == 0.0:
            self.saved = self.cwnd
            self.saved_slow_start = self.slow_start
        self.cwnd = 1.0
        self.slow_start = True
        self.delay = 0.0  # no result for an RTO: whatever queue there was has drained
        self.round_min = 0.0
        self.round_results = 0
        self.round_size = 1
        self.stalls += 1
        return True
