"""``flexcomm-train``'s argument types: each parses one option's text and names the rule it broke.

An argument type raises :class:`argparse.ArgumentTypeError`, which argparse reports as
``argument --OPTION: MESSAGE`` (exit status 2) before anything else is checked.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from flexcomm.netem import parse_schedule


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer ``>= minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def float_in(low: float, high: float, low_open: bool = True) -> Callable[[str], float]:
    """A finite number in ``(low, high]`` (``[low, high]`` where not ``low_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            bracket = "(" if low_open else "["
            upper = "inf)" if math.isinf(high) else f"{high:g}]"
            raise argparse.ArgumentTypeError(f"must be in {bracket}{low:g}, {upper}, got {text}")
        return value

    return parse


def density_or_auto(text: str) -> float | str:
    """``--density``: a fraction in (0, 1], or ``"auto"``."""
    if text.strip().lower() == "auto":
        return "auto"
    return float_in(0.0, 1.0)(text)


def bucket_cap(text: str) -> float | str:
    """``--bucket-cap-mb``: MiB in (0, inf), or ``"one"`` (one bucket holding every gradient)."""
    if text.strip().lower() == "one":
        return "one"
    try:
        float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or 'one', got {text!r}") from None
    return float_in(0.0, math.inf)(text)


def net_schedule(text: str) -> str:
    """``--net``: ``"auto"``, ``"none"`` or a bandwidth schedule netem's own parser accepts."""
    if text.strip().lower() in ("auto", "none"):
        return text.strip().lower()
    try:
        parse_schedule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()
