"""The aggregator: its backends (``ncina.aggregator.backends``, one folder each behind one
registry), the C engine two of them share (``engine``), and what every backend uses beside
them (the job, the jobs directory, the stats, two-level aggregation, the command;
docs/architecture.md)."""
