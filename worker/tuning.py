"""Defaults a training job takes from its link: DDP's gradient bucket size and the job's pool.

K, the third, follows the MTU alone (the largest chunk whose datagrams fit it:
``ncina.proto.job.default_k``); these two follow the worker link's bit rate as well. Used
by ``ncina train --link-mbit``, ``ncina topo`` (``make topo``) and ``ncina bench ddp`` when no
``--bucket-cap-mb`` or ``--pool-size`` is given (docs/topo.md, "Defaults from the link").
"""

from __future__ import annotations

import math

from ncina.proto.wire import ETH_IPV4_UDP_NCINA_HEADERS

BUCKET_WIRE_S = 0.08
"""Seconds one bucket's NC8 codes take on the worker link (see :func:`bucket_cap_mb`)."""
MIN_BUCKET_MB, MAX_BUCKET_MB = 1.0, 25.0
UNKNOWN_LINK_BUCKET_MB = 25.0
"""PyTorch's own default, for a link whose rate is not given."""

POOL_QUEUE_S = 0.004
"""Seconds of the worker link the pool's chunks fill (see :func:`pool_size`)."""
MIN_POOL, MAX_POOL = 8, 64


def bucket_cap_mb(bw_mbit: float | None) -> float:
    """DDP's bucket size (MB of float32 gradients) for a worker link of ``bw_mbit`` Mbit/s.

    A bucket's exchange starts when its last gradient is ready, so large buckets start late
    (VGG-11's 25 MB default bucket waits for three of its eight convolutions) and the last one
    is exposed whole after the backward pass. Small buckets start early, but each costs a hook
    call and a drained window (about a round trip, a few ms on a loaded machine). The bucket
    is sized so that its NC8 codes (a byte a gradient: a quarter of its float32 size) take
    ``BUCKET_WIRE_S`` on the link: tens of round trips, so the drains cost a few percent, and
    short beside a backward pass. 100 Mbit/s gives 4 MB (VGG-11, 4 workers: 0.19 of the
    exchange exposed against 0.36 with 25 MB, docs/topo.md); clamped to 1-25 MB; 25 MB
    (PyTorch's default) when the rate is not known.
    """
    if bw_mbit is None:
        return UNKNOWN_LINK_BUCKET_MB
    if not bw_mbit > 0:
        raise ValueError(f"link rate {bw_mbit} Mbit/s: must be positive")
    nc8_bytes = bw_mbit * 1e6 / 8 * BUCKET_WIRE_S
    return min(MAX_BUCKET_MB, max(MIN_BUCKET_MB, round(4 * nc8_bytes / 1e6, 1)))


def pool_size(k: int, bw_mbit: float | None, unknown: int = MAX_POOL) -> int:
    """Slots a job of ``k`` NC8 elements per chunk gets on a worker link of ``bw_mbit`` Mbit/s.

    The pool bounds the chunks a worker has in flight. Enough of them keep the link busy through
    a round trip and the scheduling gaps of a shared machine (a few ms); more only queue in front
    of the link, where their round trips grow until the retransmission timer fires and the link
    carries copies (64 jumbo chunks at 100 Mbit/s: 32 % of the packets retransmitted, docs/topo.md).
    So the pool holds ``POOL_QUEUE_S`` of the link in frames of ``k`` codes: 34 slots of MTU 1500
    at 100 Mbit/s (VGG-11: 2-3 % of the packets retransmitted, 4-4.5 % with 64), 8 (the floor)
    of MTU 9000; at most 64; ``unknown`` when the rate is not known (an unshaped link).
    """
    if k < 1:
        raise ValueError(f"k={k}: must be at least 1")
    if bw_mbit is None:
        return unknown
    if not bw_mbit > 0:
        raise ValueError(f"link rate {bw_mbit} Mbit/s: must be positive")
    frame_bits = 8 * (k + ETH_IPV4_UDP_NCINA_HEADERS)
    return min(MAX_POOL, max(MIN_POOL, math.ceil(bw_mbit * 1e6 * POOL_QUEUE_S / frame_bits)))
