"""Which of the cluster file's hosts the fabric items reach over SSH: computed from the cluster
file alone (no connection is opened), so checks and capability lookups can ask without doing I/O."""

from __future__ import annotations

from typing import Any


def fabric_hosts(spec: Any) -> list[Any]:
    """The cluster file's hosts that the fabric items can drive over SSH (ssh + fabric settings)."""
    return [h for h in spec.hosts if h.ssh is not None and getattr(h, "fabric", None) is not None]


def ssh_fabric_reason(spec: Any) -> str | None:
    """None when the cluster's fabric can be judged over SSH, else why not."""
    if spec.kind != "external":
        return "the SSH fabric path is for `kind: external` clusters"
    n = len(fabric_hosts(spec))
    return None if n >= 2 else f"{n} host(s) with both `ssh:` and `fabric:` settings; the fabric items need 2"


__all__ = ["fabric_hosts", "ssh_fabric_reason"]
