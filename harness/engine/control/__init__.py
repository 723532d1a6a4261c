"""The control plane's shared vocabulary, below both the router/worker processes (``pd``) and
``resilience``: the typed control messages and their codec, the router's routing table and event
log, and the workers' recent-window statistics. Imports nothing of ``pd`` or ``resilience``."""
