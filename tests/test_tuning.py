"""The defaults a training job takes from its link (``ncina.worker.tuning``): DDP's bucket size
and the job's pool, and how ``ncina topo``'s defaults use them."""

from __future__ import annotations

import pytest
from ncina.topo import cli as topo_cli
from ncina.worker import tuning


def test_a_bucket_is_80_ms_of_nc8_codes_on_the_link() -> None:
    # 100 Mbit/s: 1 MB of NC8 codes in 80 ms, the codes of 4 MB of float32 gradients
    assert tuning.bucket_cap_mb(100) == 4.0
    assert tuning.bucket_cap_mb(200) == 8.0
    assert tuning.bucket_cap_mb(1000) == 25.0  # 40 MB, PyTorch's default at most
    assert tuning.bucket_cap_mb(10) == 1.0  # 0.4 MB: at least 1 MB
    assert tuning.bucket_cap_mb(None) == 25.0  # an unknown link: PyTorch's default
    with pytest.raises(ValueError, match="must be positive"):
        tuning.bucket_cap_mb(0)


def test_a_pool_is_4_ms_of_the_link_in_frames() -> None:
    # MTU 1500's frames of 1456 codes (1514 bytes) at 100 Mbit/s: 121.1 us each, 33.03 in 4 ms: 34
    assert tuning.pool_size(1456, 100) == 34
    assert tuning.pool_size(1456, 1000) == 64  # 331: at most 64
    assert tuning.pool_size(8956, 100) == 8  # jumbo frames: 5.5, at least 8
    assert tuning.pool_size(1456, 10) == 8
    assert tuning.pool_size(256, 100) == 64  # 314 B frames: 160, at most 64
    assert tuning.pool_size(1456, None, unknown=17) == 17
    with pytest.raises(ValueError, match="k=0"):
        tuning.pool_size(0, 100)
    with pytest.raises(ValueError, match="must be positive"):
        tuning.pool_size(1456, -5)


def test_topology_pool_on_a_shaped_and_an_unshaped_link() -> None:
    assert topo_cli.topo_pool_size("socket", 1456, 100.0) == 34
    assert topo_cli.topo_pool_size("socket", 8956, 100.0) == 8
    assert topo_cli.topo_pool_size("socket", 8956) == 10  # unshaped: 64 chunks of MTU 1500
    assert topo_cli.topo_pool_size("bmv2", 1456, 100.0) == 8  # BMv2's input ring decides
