"""Cluster inventories (``clusters/*.yaml``): the schema (pydantic models) and loading with errors
that name file, field and fix. The handle tests receive (``ClusterHandle``, ``open_cluster``) is in
``harness.cluster``, above the probes it opens. See ``docs/clusters.md``."""

from harness.clusterfile.load import (CLUSTERS_DIR, check_before_start, check_cluster, cluster_search_path, json_schema,
                                     load_cluster, missing_ssh_files, parse_cluster, resolve_cluster_path,
                                     start_problems)
from harness.clusterfile.models import (ENGINES, KINDS, ROLES, WORKER_ROLES, Auth, BundledSettings, ClusterFile,
                                        ClusterSpec, Endpoints, FabricSettings, Host, ProcessLocator, Restart,
                                        Safety, SSHSettings, Worker, Workload)

__all__ = ["CLUSTERS_DIR", "check_before_start", "check_cluster", "cluster_search_path", "missing_ssh_files", "start_problems",
           "ENGINES", "KINDS", "ROLES", "WORKER_ROLES", "Auth", "BundledSettings", "ClusterFile",
           "ClusterSpec", "Endpoints", "FabricSettings", "Host", "ProcessLocator", "Restart",
           "SSHSettings", "Safety", "Worker", "Workload", "json_schema", "load_cluster",
           "parse_cluster", "resolve_cluster_path"]
