"""The worker side of one all-reduce job (``AllreduceClient``), split by concept: the public
call (``allreduce``), the job handshake (``handshake``), restart recovery (``recovery``), the
data paths (``datapath``: C, Python, server mode), the socket (``link``) and the errors a
transfer's outcome becomes (``errors``). This package gathers the public API as users import
it (``from ncina.worker.client import AllreduceClient``; ``RtoEstimator`` is
``ncina.worker.timing``'s)."""

from ncina.worker.client.allreduce import MODES, OPS, STAT_KEYS, AllreduceClient, check_mode
from ncina.worker.client.datapath import DATA_PATH_ENV, DATA_PATHS
from ncina.worker.client.errors import AggregatorRestartedError
from ncina.worker.client.handshake import HANDSHAKE_INTERVAL, HANDSHAKE_TIMEOUT
from ncina.worker.timing import RtoEstimator

__all__ = [
    "DATA_PATHS",
    "DATA_PATH_ENV",
    "HANDSHAKE_INTERVAL",
    "HANDSHAKE_TIMEOUT",
    "MODES",
    "OPS",
    "STAT_KEYS",
    "AggregatorRestartedError",
    "AllreduceClient",
    "RtoEstimator",
    "check_mode",
]
