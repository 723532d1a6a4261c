"""The cluster file's load hosts: machines that each run one Locust worker of a distributed load
run, started over SSH by the harness, whose Locust master runs here (harness.probes.loadgen.load_distributed,
docs/load-and-metrics.md "Load from several hosts").

    load_hosts:
      - fab-h0                                # a host under `hosts:` that has `ssh:`
      - name: gen-1                           # or a machine of its own
        address: 10.0.0.20
        ssh: {user: ops, key_file: ~/.ssh/id_ed25519, known_hosts: ~/.ssh/known_hosts_lab}
        python: /opt/harness/venv/bin/python  # has the harness and Locust installed
    load_master: {bind: 10.0.0.5, port: 5557} # this machine as the load hosts reach it

A load host is a client of the cluster, not a part of it: it needs no role, and the faults never
target it.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import model_validator

from harness.clusterfile.base import FieldProblem, Name, SSHSettings, StrictModel, Text, field_with_fix

DEFAULT_MASTER_PORT = 5557  # Locust's own default


class LoadHost(StrictModel):
    """One load host: the name of a host under ``hosts:`` (its address and SSH settings), or a
    machine of its own with ``address`` and ``ssh``."""

    name: Name = field_with_fix("write the name of a host under `hosts:`, or `name: gen-1` with address and ssh")
    address: Text | None = field_with_fix("write e.g. `address: 10.0.0.20`",
                                          "default: the address of the host of this name under `hosts:`",
                                          default=None)
    ssh: SSHSettings | None = field_with_fix("write `ssh: {user: ops, key_file: PATH, known_hosts: PATH}`",
                                             "default: the SSH settings of the host of this name under `hosts:`",
                                             default=None)
    python: Text = field_with_fix("write e.g. `python: /opt/harness/venv/bin/python`",
                                  "the interpreter on the load host that has the harness and Locust installed",
                                  default="python3")
    work_dir: Text = field_with_fix("write an absolute path such as /tmp/harness-load",
                                    "where the worker writes its records and log (read back over SFTP, then "
                                    "removed)", default="/tmp/harness-load")

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _checked(self) -> "LoadHost":
        if (self.address is None) != (self.ssh is None):
            given, absent = ("address", "ssh") if self.address is not None else ("ssh", "address")
            raise FieldProblem(f"load host {self.name!r} has {given} but no {absent}",
                               "give both address and ssh, or neither to use the host of this name under `hosts:`",
                               field=absent)
        if not self.work_dir.startswith("/"):
            raise FieldProblem(f"work_dir {self.work_dir!r} is not an absolute path",
                               "write an absolute path such as /tmp/harness-load", field="work_dir")
        return self


class LoadMaster(StrictModel):
    """Where the Locust master listens for the load hosts' workers."""

    bind: Text | None = field_with_fix("write the address of this machine that the load hosts reach, e.g. 10.0.0.5",
                                       "default: this machine's source address on the route to the load hosts",
                                       default=None)
    port: int = field_with_fix("use 1..65535", "the master's port", default=DEFAULT_MASTER_PORT, ge=1, le=65535)
    join_timeout_s: float = field_with_fix("write a plain number such as 60",
                                           "how long the workers have to join the master", default=60.0, gt=0,
                                           allow_inf_nan=False)


def check_load_hosts(load_hosts: Sequence[LoadHost], hosts: Sequence[Any]) -> None:
    """Cross-checks against ``hosts:``: unique names, a bare name refers to a host with ``ssh:``,
    a machine of its own does not reuse a host's name. Raises FieldProblem (field from the file's root)."""
    by_name = {h.name: h for h in hosts}
    seen: set[str] = set()
    for i, lh in enumerate(load_hosts):
        if lh.name in seen:
            raise FieldProblem(f"load host {lh.name!r} is listed twice", "list each load host once (one Locust "
                               "worker each)", field=f"load_hosts[{i}].name")
        seen.add(lh.name)
        host = by_name.get(lh.name)
        if lh.address is not None:
            if host is not None:
                raise FieldProblem(f"{lh.name!r} is a host under `hosts:` and also has its own address and ssh",
                                   f"write just `- {lh.name}` to use that host, or give this load host another name",
                                   field=f"load_hosts[{i}]")
            continue
        if host is None:
            raise FieldProblem(f"load host {lh.name!r} is not a host under `hosts:`",
                               f"use one of {', '.join(sorted(by_name)) or '(none)'}, or give it address and ssh",
                               field=f"load_hosts[{i}].name")
        if host.ssh is None:
            raise FieldProblem(f"host {lh.name!r} has no ssh settings: its Locust worker is started over SSH",
                               f"add `ssh:` to host {lh.name!r} under `hosts:`", field=f"load_hosts[{i}].name")


def resolved(load_host: LoadHost, hosts: Sequence[Any]) -> tuple[str, Any]:
    """(address, SSHSettings) of a load host, from ``hosts:`` when it names one."""
    if load_host.address is not None:
        return load_host.address, load_host.ssh
    host = next(h for h in hosts if h.name == load_host.name)
    return host.address, host.ssh
