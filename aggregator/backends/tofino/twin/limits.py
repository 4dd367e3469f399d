"""What the Tofino program's design (``p4/tofino/``, docs/tofino.md) does not do, in one place
(``ncina.proto.profiles``, the ``tofino`` job profile's definition): the twin's control plane
refuses a job that needs it, with one sentence, and the cross-backend tests skip a scenario that
needs it with the same sentence as their reason.
"""

from __future__ import annotations

from ncina.aggregator.jobs import JobConfig
from ncina.proto.profiles import (
    LACKS,
    tofino_problems,
)

__all__ = ["LACKS", "refusal"]


def refusal(config: JobConfig, k: int) -> str | None:
    """Why the design cannot run ``config`` on a twin built for ``k`` lanes, or None (the first
    of ``ncina.proto.profiles.tofino_problems``)."""
    problems = tofino_problems(
        job=config.job, workers=config.workers, k=max(k, config.k), result=config.result_format,
        uplink=config.uplink_format, keyed=config.key is not None,
    )  # fmt: skip
    return problems[0] if problems else None
