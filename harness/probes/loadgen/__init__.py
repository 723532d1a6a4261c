"""Load generation: Locust profiles (workload), the runner that starts Locust here or on several load
hosts (load, load_distributed, load_hosts), the Locust user itself (locust_user, locustfile: the only
modules that import locust, inside the Locust process), the prompt calibration, the KV-use drive of
6.1.3 by load, and ``python -m harness load`` (cli)."""
