"""The Python reference backend: the protocol one concept per file, named as
``aggregator/engine/*.c`` and ``p4/*.p4`` name them (docs/architecture.md), behind one blocking
UDP socket (``driver``)."""
