"""Fault injection that always reverts: inject -> verify -> revert -> verify_reverted, locally or
over SSH, with a persistent ledger so even a SIGKILLed run is cleaned up by the next one. Faults run
their commands through the executors of :mod:`harness.hosts`.

A new fault kind is one ``Fault`` subclass; import its module here so ``Fault.from_ledger`` knows
the kind in a fresh process (``python -m harness revert``). See docs/faults.md.
"""

from harness.faults.cluster_settings import LiveMigration, SpeculativeDecoding
from harness.faults.base import Action, Fault, FaultRecord, RecordStatus, no_ledger
from harness.ids import new_fault_id
from harness.faults.dcgm import DcgmInject
from harness.faults.gpu import EccPoison, HbmFill
from harness.faults.gpu_fill_host import HostHbmFill
from harness.faults.ledger import Ledger, LedgerStatus, state_dir
from harness.faults.network import NicFlap, PfcStorm
from harness.faults.process import ProcessHang, ProcessKill, select_targets
from harness.faults.runner import FaultRunner
from harness.signals import Terminated

__all__ = [
    "Action", "DcgmInject", "EccPoison", "Fault", "FaultRecord", "FaultRunner", "HbmFill", "HostHbmFill", "Ledger",
    "LedgerStatus", "LiveMigration", "NicFlap", "PfcStorm", "ProcessHang", "ProcessKill", "RecordStatus",
    "SpeculativeDecoding", "Terminated", "new_fault_id", "no_ledger", "select_targets", "state_dir"
]
