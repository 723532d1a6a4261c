"""The conformance suites users run, shipped in the package so that a wheel install can run them
from any directory: ``harness run --cluster=NAME`` (or ``pytest --pyargs harness.suites``). In a
checkout, ``suites/`` is a link to this folder, so ``pytest suites/`` and its node ids
(``suites/test_62_slo.py::...``) are unchanged."""
