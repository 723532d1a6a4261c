"""PD-inference chaos and SLO conformance harness.

See README.md and docs/ for the layout; shared contracts live in
``harness.errors`` (error root) and ``harness.engine.core.types`` (engine API types).
"""

__version__ = "0.1.0"
