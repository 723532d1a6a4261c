"""What the scenarios record and the checks judge: the typed records both sides share.

A layer below both (issue 34): harness/scenarios/ builds these records while it drives load and
faults; harness/checks/ judges them and imports nothing from harness/scenarios/. This package
depends only on the probes' request records, the fault types and the statistics (no I/O).

- records.py: a fault as the client sees it (ClientFault), a kill's window (KillWindow)
- fault_marks.py: an injected process fault (FaultMark) and the readings of request records both
  sides need (record_wall_s, first_success_sent_after, affected_request_id)
- migration.py: one watched hot-migration attempt (MigrationAttempt)
- ecc_dcgm.py: one DCGM injection and its polls (Injection)
- soak.py: a soak's scheduled fault (ScheduledFault) and what happened to it (SoakOutcome)
"""
