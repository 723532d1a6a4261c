"""Faults under load: each scenario injects faults through the fault runner while the harness's own
load runs, and returns its records (request records, fault marks) for the checks to judge."""
