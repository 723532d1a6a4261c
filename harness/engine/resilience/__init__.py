"""Resilience: delta-based health scores, degradation levels and their actions, live KV
migration (router and worker sides), the workers' fault hooks, and the admin API over them."""
