"""The checklist the conformance suites judge against (``section6.yaml`` here, a link to
``checklists/section6.yaml`` in a checkout) as pydantic models, and the project's one style of
validating a hand-edited file (:mod:`harness.checklists.validation`). A leaf: it imports only
harness.errors, so every layer may use it. See checklists/section6.yaml."""

from harness.checklists.models import (COMPARISONS, DEFAULT_CHECKLIST, Checklist, ChecklistFile, ChecklistItem,
                                       ItemEntry, Threshold, ThresholdEntry, default_checklist, json_schema)

__all__ = ["COMPARISONS", "DEFAULT_CHECKLIST", "Checklist", "ChecklistFile", "ChecklistItem", "ItemEntry",
           "Threshold", "ThresholdEntry", "default_checklist", "json_schema"]
