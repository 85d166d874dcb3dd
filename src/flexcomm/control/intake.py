"""The agreed measurements of an agreement point, fed to :class:`~flexcomm.control.exchange.ExchangeChooser`.

Every rank receives the same agreed samples in the same order (:mod:`flexcomm.control.measurements`)
and feeds them here in that order, so every rank's chooser and cost model hold the same state.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexcomm.control.exchange import ExchangeChooser
from flexcomm.control.measurements import AgreedSample


def feed_agreed(chooser: ExchangeChooser, agreed: Sequence[AgreedSample], dense_period: float, other_period: float,
                smallest_probe: int, world: int) -> None:
    """Fold one agreement point's samples and the guard's periods (0: none ran) into ``chooser``."""
    last = agreed[-1].sample.step
    # The collectives' own times are clean network samples (the raw ones counted queueing).  Those
    # smaller than the smallest probe are left to the per-pair calibration: a shaped link lets a
    # burst through faster than its rate, and a plan of small messages (low-rank factors, 20-33 KB
    # on the MLP) fitted 20 Mbit/s as several Gbit/s, rating dense cheap again and again.
    # Step 0's exchanges carry one-time costs (buffers allocated, each collective's and kernel's first
    # call): from step 0 AG-Topk on a 268k-element bucket was rated 10-12 ms at 1 Gbit (predicted 0.4-0.9)
    # and not run again for the whole 1 Gbit phase (MLP group, seed 4, flex at 0.01).
    fed = [a for a in agreed if a.sample.step > 0]
    shifted = chooser.estimator.observe_batch(a.sample.observation._replace(seconds=a.service) for a in fed
                                              if a.sample.observation.nbytes >= smallest_probe)
    # A link that changed makes the guard's periods from before it (or across it) stale too: seen only
    # in the periods, all-dense16 steps measured on a fast link (19 ms) were compared with plan steps
    # measured after a drop to 100 Mbit/s (56 ms) and held at 120 ms (MLP group, seed 4, at c90b666).
    chooser.observe_steps(last, dense_period or None, other_period or None, link_changed=bool(shifted))
    chooser.sizes = {a.sample.bucket: (a.sample.numel, a.sample.value_bytes) for a in agreed if a.sample.step == last}
    for step in sorted({a.sample.step for a in fed}):
        chooser.observe(step, [a.step_sample() for a in fed if a.sample.step == step and a.sample.bucket in chooser.sizes],
                        world)
