"""Harnesses that the benchmarks (``ncina.bench``) and the tests share: what drives the system
from outside as a user's workers and a stranger would. One module per concept:

- ``fuzzing``: hostile datagrams, and a stranger throwing them during a real job;
- ``faults``: all-reduce through a lossy aggregator, with a worker killed, across a restart;
- ``aggregators``: an aggregator process for one job, its stats on request, stopped by PID;
- ``workers``: the worker processes of a timed all-reduce (INA or gloo), started together;
- ``reference``: what those workers send and what their results must be, without an
  aggregator; inputs whose sums are exact;
- ``figures``: lower medians and ratios over repeated runs;
- ``links``: a Mininet fabric's uplink counters and the share of the bandwidth they show;
- ``training``: training runs on loopback with each compression method in its mode.

Benchmarks import from here and tests import from here; tests never import ``ncina.bench``
(tests/test_imports.py): a benchmark is tested through its command, ``ncina bench NAME``.
"""
