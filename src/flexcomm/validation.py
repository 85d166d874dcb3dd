"""Argument checks with messages that name the option and the allowed values."""


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")


def check_fraction(name: str, value: object, low_open: bool, high_open: bool, extra: str = "") -> None:
    """``value`` in the unit interval, each end open or closed as said."""
    _check_number(name, value)
    low_ok = value > 0.0 if low_open else value >= 0.0
    high_ok = value < 1.0 if high_open else value <= 1.0
    if not (low_ok and high_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name} must be in {interval}{extra}, got {value}")


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
