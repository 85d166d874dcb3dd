"""Emulated slow networks for data-parallel jobs on one Linux machine.

``parse_schedule`` (pure) turns ``"1gbit:30s,50mbit/5ms~1ms:30s,300mbit"``
into phases. ``EmulatedCluster`` (root only) gives each rank its own network
namespace behind a tbf-shaped bridge, with a real one-way delay per link
(netem, or the user-space switch in :mod:`flexcomm.netem.delay` where the
kernel lacks netem), and ``ScheduleRunner`` changes rate and delay at each
phase boundary while the job runs. Call ``netem_available()`` to find
out (and say why not) before trying. ``flexcomm-netem`` (:mod:`.cli`) runs any
training command that way.

Modules by role: :mod:`.schedule` (the schedule language), :mod:`.commands`
(``ip``/``tc`` wrappers, availability), :mod:`.topology` (namespaces, veths,
neighbours, qdiscs), :mod:`.delay` / :mod:`.delay_control` (the delay switch
process and the cluster's side of it), :mod:`.delay_path` (netem or the
switch, chosen and built for a cluster), :mod:`.cleanup` (signals, atexit, stale
namespaces), :mod:`.runner` (walking a schedule), :mod:`.cluster` (the cluster
that composes them), :mod:`.cli` (``flexcomm-netem``).
"""

from .cleanup import cleanup_stale
from .cluster import DELAY_BACKENDS, EmulatedCluster
from .commands import (
    NetemCommandError,
    NetemUnavailable,
    netem_available,
    tbf_args,
    tbf_burst_bytes,
)
from .runner import RateChange, RateSetter, ScheduleRunner
from .schedule import (
    SCHEDULE_FORMAT,
    Phase,
    format_rate,
    parse_delay,
    parse_duration,
    parse_rate,
    parse_schedule,
    phase_at,
)
from .topology import MAX_HOSTS, SUBNET

__all__ = [
    "EmulatedCluster",
    "cleanup_stale",
    "MAX_HOSTS",
    "DELAY_BACKENDS",
    "SUBNET",
    "NetemCommandError",
    "NetemUnavailable",
    "netem_available",
    "tbf_args",
    "tbf_burst_bytes",
    "RateChange",
    "RateSetter",
    "ScheduleRunner",
    "SCHEDULE_FORMAT",
    "Phase",
    "format_rate",
    "parse_delay",
    "parse_duration",
    "parse_rate",
    "parse_schedule",
    "phase_at",
]
