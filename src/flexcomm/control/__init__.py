"""Control: decisions every rank takes identically (which exchange; later, which density)."""

from flexcomm.control.exchange import Choice, ExchangeChooser

__all__ = ["Choice", "ExchangeChooser"]
