"""Cluster inventories (``clusters/*.yaml``): the schema (pydantic models), loading with errors
that name file, field and fix, and the handle tests receive. See ``docs/clusters.md``."""

from harness.clusterfile.handle import ClusterHandle, open_cluster, settings_spec
from harness.clusterfile.load import (CLUSTERS_DIR, check_before_start, check_cluster, cluster_search_path, json_schema,
                                     load_cluster, missing_ssh_files, parse_cluster, resolve_cluster_path)
from harness.clusterfile.models import (ENGINES, KINDS, ROLES, WORKER_ROLES, Auth, BundledSettings, ClusterFile,
                                        ClusterSpec, Endpoints, FabricSettings, Host, ProcessLocator, Restart,
                                        Safety, SSHSettings, Worker, Workload)

__all__ = ["CLUSTERS_DIR", "check_before_start", "check_cluster", "cluster_search_path", "missing_ssh_files",
           "ENGINES", "KINDS", "ROLES", "WORKER_ROLES", "Auth", "BundledSettings", "ClusterFile",
           "ClusterHandle", "ClusterSpec", "Endpoints", "FabricSettings", "Host", "ProcessLocator", "Restart",
           "SSHSettings", "Safety", "Worker", "Workload", "json_schema", "load_cluster", "open_cluster",
           "parse_cluster", "resolve_cluster_path", "settings_spec"]
