"""The Tofino program ``p4/tofino/``: its generator (``gen``), its build with p4c-barefoot
(``toolchain``, ``make p4-tofino``) and the control plane of its v1model twin ``p4/twin/``, which
the bmv2 backend runs with ``--p4-profile tofino`` (``twin``, with the design's limits); see
docs/tofino.md."""
