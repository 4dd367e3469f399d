"""``ncina bench aggregator``'s options, without root or a switch (runs everywhere)."""

from __future__ import annotations

import pytest

from ncina.bench import aggregator
from ncina.cli import build_parser


def test_the_p4_profile_reaches_the_bmv2_aggregator_only() -> None:
    """``--p4-profile tofino`` is the bmv2 backend's: any other backend is refused before
    anything is set up, and it parses to what ``measure`` passes on as ``--p4-profile``."""
    parse = build_parser().parse_args
    args = parse(["bench", "aggregator", "--backend", "bmv2", "--p4-profile", "tofino"])
    assert (args.backend, args.p4_profile) == ("bmv2", "tofino")
    assert parse(["bench", "aggregator"]).p4_profile == "default"
    with pytest.raises(ValueError, match="--p4-profile is the bmv2 backend's"):
        aggregator.run(parse(["bench", "aggregator", "--backend", "dpdk",
                              "--p4-profile", "tofino"]))  # fmt: skip
