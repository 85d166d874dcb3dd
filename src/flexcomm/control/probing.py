"""When ``flex`` probes the collectives: at start, then every ``probe_every`` steps within a budget.

A probe times each collective kind at the configured sizes (64 KiB and 1 MiB by default), above
a shaped link's burst, so that the (alpha, beta) fit sees the link's rate; a size whose message
would take over ~25 ms by the kind's smaller message is cut to about that
(:func:`~flexcomm.cost.probe_size`: 1 MiB at 20 Mbit/s would take 0.4 s per kind, 1.3 s for
the probe).  Even so a probe costs a few steps of a fast plan on a slow link, so a
probe that is due is put off while its predicted time exceeds ``PROBE_BUDGET`` of the plan's
predicted time since the last probe, up to ``MAX_PROBE_STRETCH`` times ``probe_every`` steps.
Between probes the plan's own exchanges (those at least the smallest probe's size) keep the fit
current.  Both predictions come from the agreed model and plan: every rank decides alike.
"""

from __future__ import annotations

from collections.abc import Callable

#: A probe is put off while it would cost more than this share of the plan's steps since the last one...
PROBE_BUDGET = 0.02
#: ...but not beyond this many times ``probe_every`` steps.
MAX_PROBE_STRETCH = 8


def probe_due(since: int, probe_every: int, probe_seconds: Callable[[], float], plan_seconds: Callable[[], float]) -> bool:
    """Whether a probe runs ``since`` steps after the last one: ``probe_seconds()`` is the probe's predicted
    time, ``plan_seconds()`` the plan's predicted step (NaN or 0 without a plan: no budget, probe)."""
    if since < probe_every:
        return False
    if since >= MAX_PROBE_STRETCH * probe_every:
        return True
    plan = plan_seconds()
    return not plan > 0.0 or probe_seconds() <= PROBE_BUDGET * since * plan
