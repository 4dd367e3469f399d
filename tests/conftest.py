"""Keep the repository root off ``sys.path`` during tests.

``python -m pytest`` run from the repository root puts the root on ``sys.path``, where the
``mininet/`` folder (imported as ``ncina.topo``) would shadow Debian's Mininet package. Dropping
the root before any test module is imported keeps ``import mininet`` pointing at the real one.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
