"""One owner of SIGINT/SIGTERM (harness/signals.py): the first signal interrupts and later ones are
noted; a signal inside a critical or deferred block waits for the outermost block to end, then
interrupts, even from another thread; outside a run a teardown still waits; the fault runner uses the
owner it is given and installs nothing of its own."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from harness.faults import FaultRunner, Ledger
from harness.signals import SignalOwner, Terminated, deferred


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.2)   # the handler runs in the main thread between bytecodes


def test_a_teardown_outside_a_run_waits_then_acts_as_the_previous_handler():
    # what a fresh Python process has: the test must not depend on what an earlier test left
    signal.signal(signal.SIGINT, signal.default_int_handler)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: still waits
            done.append("teardown finished")
    assert done == ["teardown finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_outside_a_run_a_teardown_under_sig_ign_is_not_interrupted():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with deferred():
        _deliver(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


def test_the_owner_interrupts_once_then_only_notes():
    before = signal.getsignal(signal.SIGTERM)
    owner = SignalOwner().install()
    try:
        assert SignalOwner.current() is owner
        with pytest.raises(Terminated) as exc:
            _deliver(signal.SIGTERM)
        assert exc.value.exit_code == 143
        _deliver(signal.SIGINT)   # a second signal while the run unwinds: noted, not raised
        _deliver(signal.SIGTERM)
        assert owner.interrupted == signal.SIGTERM
    finally:
        owner.restore()
    assert signal.getsignal(signal.SIGTERM) == before and SignalOwner.current() is None


def test_a_finished_run_ignores_signals_even_after_restore():
    owner = SignalOwner().install()
    owner.finish()
    _deliver(signal.SIGINT)           # after the report: noted only
    owner.restore()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    _deliver(signal.SIGINT)
    assert owner.interrupted is None


def test_a_signal_in_a_critical_block_waits_for_the_outermost_block_then_interrupts():
    owner = SignalOwner().install()
    steps = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with owner.critical():
                with owner.deferred():
                    _deliver(signal.SIGINT)
                    steps.append("inner done")
                steps.append("outer done")   # the inner block's end does not act: the outer still runs
            steps.append("after")            # never reached
        assert steps == ["inner done", "outer done"] and owner.interrupted == signal.SIGINT
    finally:
        owner.restore()


def test_a_signal_waiting_in_a_block_that_fails_still_stops_the_run():
    owner = SignalOwner().install()
    try:
        with pytest.raises(Terminated) as exc:
            with owner.critical():
                _deliver(signal.SIGTERM)
                raise ValueError("a revert step failed")
        assert isinstance(exc.value.__context__, ValueError)   # the error is kept as its context
    finally:
        owner.restore()


def test_a_signal_held_by_a_worker_threads_block_is_delivered_to_the_main_thread():
    owner = SignalOwner().install()
    entered, release = threading.Event(), threading.Event()

    def change() -> None:
        with owner.critical():
            entered.set()
            release.wait(10)

    worker = threading.Thread(target=change)
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.start()
            assert entered.wait(10)
            _deliver(signal.SIGINT)          # held: the worker's change is not whole yet
            assert owner.interrupted is None
            release.set()
            worker.join(10)
            time.sleep(0.5)                  # re-delivered to this thread once the block ended
        assert owner.interrupted == signal.SIGINT
    finally:
        release.set()
        worker.join(10)
        owner.restore()


def test_the_runner_uses_the_owner_it_is_given_and_records_its_interrupt(tmp_path):
    owner = SignalOwner().install()
    handler = signal.getsignal(signal.SIGINT)
    try:
        runner = FaultRunner(Ledger.for_cluster("local", tmp_path), signals=owner)
        with pytest.raises(KeyboardInterrupt):
            with runner:
                assert signal.getsignal(signal.SIGINT) == handler   # nothing of its own
                _deliver(signal.SIGINT)
        assert owner.interrupted == signal.SIGINT and runner.signals is owner
    finally:
        owner.restore()


def test_a_runner_without_an_owner_installs_one_for_its_block_and_gives_it_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    runner = FaultRunner(Ledger.for_cluster("local", tmp_path))
    with pytest.raises(Terminated):
        with runner:
            assert SignalOwner.current() is not None
            _deliver(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == before and SignalOwner.current() is None
