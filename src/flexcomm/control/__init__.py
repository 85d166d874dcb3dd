"""Control: decisions every rank takes identically (which exchange, which density).

:class:`StepPlanner` is the one interface the state calls; the chooser and the density
controller behind it are its parts.
"""

from flexcomm.control.density import DEFAULT_CANDIDATES, RULES, DensityController
from flexcomm.control.front import Candidate, pareto_front
from flexcomm.control.exchange import Choice, ExchangeChooser
from flexcomm.control.planner import Plan, StepPlanner

__all__ = ["DEFAULT_CANDIDATES", "RULES", "Candidate", "Choice", "DensityController", "ExchangeChooser", "Plan",
           "StepPlanner", "pareto_front"]
