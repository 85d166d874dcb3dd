"""Bandwidth schedules: parse strings like ``"1gbit:30s,50mbit/5ms:30s,300mbit"``.

The grammar is deliberately tiny so a schedule fits on a command line::

    schedule := "none" | "" | phase ("," phase)*
    phase    := RATE ["/" DELAY ["~" JITTER]] [":" DURATION]

* ``RATE`` uses tc's units, with tc's meaning (``man tc``, section RATES;
  matched case-insensitively, as tc does):

  ========================  ====================================
  suffix                    bits per second
  ========================  ====================================
  ``bit``                   1
  ``kbit`` ``mbit`` ...     10**3, 10**6, 10**9, 10**12 (SI)
  ``kibit`` ``mibit`` ...   2**10, 2**20, 2**30, 2**40 (IEC)
  ``bps``                   8 (**bytes** per second, as in tc)
  ``kbps`` ``mbps`` ...     8 * 10**3, 8 * 10**6, ... (bytes, SI)
  ``kibps`` ``mibps`` ...   8 * 2**10, 8 * 2**20, ... (bytes, IEC)
  ========================  ====================================

  So ``"1mbps"`` is 8 Mbit/s, exactly as ``tc ... rate 1mbps`` would be. A
  bare number is rejected (tc reads it as bits/s, but it is too easy to mean
  bytes), so every rate must carry a unit.
* ``DELAY`` is a one-way delay: ``us``, ``ms`` or ``s`` (e.g. ``5ms``).
* ``JITTER`` (same units) makes each packet's delay uniform in
  ``[DELAY - JITTER, DELAY + JITTER]`` (clipped at 0), as netem's default
  jitter does; packets may then be reordered. ``1gbit/5ms~1ms:30s``.
* ``DURATION`` is ``ms``, ``s``, ``m`` (minutes) or ``h``. Every phase but the
  last needs one; a last phase without one lasts until the job ends.

``"none"`` (any case) or an empty string means "no emulation" and parses to
an empty list.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "Phase",
    "SCHEDULE_FORMAT",
    "parse_rate",
    "parse_duration",
    "parse_delay",
    "parse_schedule",
    "format_rate",
    "phase_at",
    "describe_phases",
]

SCHEDULE_FORMAT = (
    "RATE[/DELAY][:DURATION][,RATE[/DELAY][:DURATION]...], e.g. "
    "'1gbit:30s,50mbit/5ms:30s,300mbit' (rates: bit kbit mbit gbit tbit, "
    "kibit..., bps kbps mbps gbps = bytes/s as in tc; delays: us ms s; "
    "durations: ms s m h; only the last phase may omit its duration; "
    "a delay may carry jitter as DELAY~JITTER, e.g. '1gbit/5ms~1ms:30s'; "
    "'none' or '' = no emulation)"
)

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_IEC = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}


def _rate_units() -> dict[str, float]:
    """Build tc's rate suffix table (suffix -> bits per second)."""
    units: dict[str, float] = {}
    for prefix, scale in {**_SI, **_IEC}.items():
        units[f"{prefix}bit"] = scale
        units[f"{prefix}bps"] = 8.0 * scale
    return units


_RATE_UNITS = _rate_units()
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class Phase:
    """One step of a schedule.

    Attributes:
        rate_bps: link rate in bits per second (> 0).
        duration_s: how long the phase lasts; ``None`` = until the end (only
            allowed for the last phase).
        delay_s: requested one-way delay in seconds (0 = none); see
            ``EmulatedCluster`` for how it is applied (netem, or a user-space
            delay switch where the kernel lacks netem).
        jitter_s: each packet's delay is uniform in ``delay_s +- jitter_s``
            (clipped at 0); 0 keeps packets in order.
    """

    rate_bps: float
    duration_s: float | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0


def _split_number_unit(text: str, what: str, units: dict[str, float], context: str) -> float:
    """Parse ``<number><unit>`` against ``units``; ValueError names the bad part."""
    match = _NUMBER_UNIT.match(text)
    if match is None:
        raise ValueError(
            f"bad {what} {text!r} in {context!r}: expected a number followed by one of "
            f"{sorted(units)}; schedule format: {SCHEDULE_FORMAT}"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in units:
        hint = "a unit is required" if unit == "" else f"unknown unit {unit!r}"
        raise ValueError(
            f"bad {what} {text!r} in {context!r}: {hint}; expected one of {sorted(units)}; "
            f"schedule format: {SCHEDULE_FORMAT}"
        )
    value = number * units[unit]
    if not math.isfinite(value):
        raise ValueError(f"bad {what} {text!r} in {context!r}: not a finite number")
    return value


def _parse_positive(text: str, what: str, units: dict[str, float], context: str | None) -> float:
    ctx = text if context is None else context
    value = _split_number_unit(text, what, units, ctx)
    if value <= 0:
        raise ValueError(f"bad {what} {text!r} in {ctx!r}: must be > 0")
    return value


def parse_rate(text: str, context: str | None = None) -> float:
    """Parse a tc-style rate (``"50mbit"``, ``"1gbit"``, ``"10mbps"``) to bits/s.

    Raises ValueError for missing/unknown units and for rates <= 0, because a
    zero-rate tbf would silently black-hole the link.
    """
    return _parse_positive(text, "rate", _RATE_UNITS, context)


def parse_duration(text: str, context: str | None = None) -> float:
    """Parse a phase duration (``"30s"``, ``"500ms"``, ``"2m"``) to seconds (> 0)."""
    return _parse_positive(text, "duration", _DURATION_UNITS, context)


def parse_delay(text: str, context: str | None = None) -> float:
    """Parse a one-way delay (``"5ms"``, ``"200us"``) to seconds (>= 0)."""
    ctx = text if context is None else context
    return _split_number_unit(text, "delay", _DELAY_UNITS, ctx)


def _parse_phase(text: str) -> Phase:
    """Parse one ``RATE[/DELAY[~JITTER]][:DURATION]`` item."""
    if text.strip() == "":
        raise ValueError(f"empty phase in schedule; schedule format: {SCHEDULE_FORMAT}")
    rate_part, sep, duration_part = text.partition(":")
    if sep and ":" in duration_part:
        raise ValueError(f"bad phase {text!r}: more than one ':'; schedule format: {SCHEDULE_FORMAT}")
    rate_text, slash, delay_text = rate_part.partition("/")
    if slash and "/" in delay_text:
        raise ValueError(f"bad phase {text!r}: more than one '/'; schedule format: {SCHEDULE_FORMAT}")
    delay_text, tilde, jitter_text = delay_text.partition("~")
    if tilde and "~" in jitter_text:
        raise ValueError(f"bad phase {text!r}: more than one '~'; schedule format: {SCHEDULE_FORMAT}")
    rate = parse_rate(rate_text, text)
    delay = parse_delay(delay_text, text) if slash else 0.0
    jitter = parse_delay(jitter_text, text) if tilde else 0.0
    duration = parse_duration(duration_part, text) if sep else None
    return Phase(rate_bps=rate, duration_s=duration, delay_s=delay, jitter_s=jitter)


def parse_schedule(text: str | None) -> list[Phase]:
    """Parse a schedule string into phases; ``"none"``/empty/None gives ``[]``.

    Every phase but the last must have a duration, because a phase with no end
    would make the following phases unreachable (almost certainly a typo).
    """
    if text is None or text.strip() == "" or text.strip().lower() == "none":
        return []
    items = text.split(",")
    phases = [_parse_phase(item) for item in items]
    for item, phase in zip(items[:-1], phases[:-1]):
        if phase.duration_s is None:
            raise ValueError(
                f"phase {item.strip()!r} has no duration but is not the last phase; "
                f"schedule format: {SCHEDULE_FORMAT}"
            )
    return phases


def format_rate(rate_bps: float) -> str:
    """Render a rate for tc as whole bits per second (``"50000000bit"``).

    Whole bits avoid tc re-interpreting fractional or prefixed values; tbf
    takes 64-bit rates, so 10 Gbit and above are fine.
    """
    bits = int(round(rate_bps))
    if bits <= 0:
        raise ValueError(f"rate must be >= 1 bit/s, got {rate_bps!r}")
    return f"{bits}bit"


def phase_at(phases: list[Phase], elapsed_s: float) -> Phase | None:
    """Return the phase active ``elapsed_s`` seconds after the schedule started.

    After a finite schedule ends, the last phase stays in force (the link keeps
    its last rate). Returns None for an empty schedule.
    """
    if not phases:
        return None
    t = 0.0
    for phase in phases:
        if phase.duration_s is None or elapsed_s < t + phase.duration_s:
            return phase
        t += phase.duration_s
    return phases[-1]


def describe_phases(phases: list[Phase]) -> str:
    """Human-readable schedule, for logs: ``100 Mbit/s, delay 5ms for 30s; 1000 Mbit/s until the end``."""
    if not phases:
        return "no shaping"
    parts = []
    for p in phases:
        dur = "until the end" if p.duration_s is None else f"for {p.duration_s:g}s"
        delay = f", delay {p.delay_s * 1e3:g}ms" if p.delay_s else ""
        if p.jitter_s:
            delay += f" ~{p.jitter_s * 1e3:g}ms jitter"
        parts.append(f"{p.rate_bps / 1e6:g} Mbit/s{delay} {dur}")
    return "; ".join(parts)
