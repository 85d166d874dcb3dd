"""Control: decisions every rank takes identically (which exchange, which density)."""

from flexcomm.control.density import DEFAULT_CANDIDATES, RULES, Candidate, DensityController, pareto_front
from flexcomm.control.exchange import Choice, ExchangeChooser

__all__ = ["DEFAULT_CANDIDATES", "RULES", "Candidate", "Choice", "DensityController", "ExchangeChooser", "pareto_front"]
