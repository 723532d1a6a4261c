"""Prefill/Decode disaggregation: the router (global scheduler) and its routing table, the worker
processes (control session + engine thread), the typed control messages between them, and the
topology that starts them all."""
