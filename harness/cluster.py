"""Cluster inventories: the public names, kept importable from here. The code lives in
``harness.clusterfile`` (models, loading, the handle); see ``docs/clusters.md``."""

from harness.clusterfile import *  # noqa: F401,F403
from harness.clusterfile import __all__  # noqa: F401
