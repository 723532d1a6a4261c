"""Observers of the cluster's workers: which process is each worker and is it healthy (inventory),
when a restarted worker is back serving (rejoin, rejoin_probe), their leaks (leaks, external_leaks)
and their GPUs (gpu: NVML here; gpu_hosts, nvsmi: over SSH)."""
