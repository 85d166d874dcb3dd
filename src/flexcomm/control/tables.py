"""Per-(bucket, exchange) tables of the exchange chooser: lookups and their plain-value form for checkpoints."""

from __future__ import annotations

from typing import Any

Table = dict[tuple[int, str], Any]


def own_or_mean(table: Table, bucket: int, exchange: str) -> float:
    """``table[bucket, exchange]``; for an unmeasured pair the mean over the exchange's other buckets, else 1."""
    own = table.get((bucket, exchange))
    if own is not None:
        return own
    others = [v for (_, e), v in sorted(table.items()) if e == exchange]
    return sum(others) / len(others) if others else 1.0


def drop_buckets(table: Table, buckets: set[int]) -> None:
    """Delete every pair of ``buckets`` from ``table``."""
    for key in [key for key in table if key[0] in buckets]:
        del table[key]


def pairs(table: Table) -> list[list[Any]]:
    """The table as ``[bucket, exchange, value]`` rows (checkpoints load with ``weights_only=True``)."""
    return [[b, e, v] for (b, e), v in sorted(table.items())]


def unpairs(rows: list[list[Any]]) -> Table:
    return {(int(b), str(e)): v for b, e, v in rows}
