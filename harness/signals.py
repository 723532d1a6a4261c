"""The one owner of SIGINT and SIGTERM in a harness process.

A conformance run must survive its own exit paths: SIGTERM unwinds like Ctrl-C (every fixture tears
down what it built, the report is written, the exit code says it was interrupted) instead of dying
with 143; a second Ctrl-C while the run unwinds is only noted; a fault is never left half-changed
because a signal arrived between writing its ledger entry and changing the target. One object,
:class:`SignalOwner`, holds that state; the pytest plugin installs it for the run and the fault runner
is given it. Two kinds of block make signals wait:

- :meth:`SignalOwner.critical`: a change that must be whole (ledger, undo stack and target agree);
- :meth:`SignalOwner.deferred`: work that must finish (a teardown; a second Ctrl-C must not leave the
  router and the namespaces behind).

Inside either, a signal is noted; when the outermost such block ends, the first noted signal is acted
on: raised as ``KeyboardInterrupt`` (SIGINT) or :class:`Terminated` (SIGTERM) in the main thread, or
re-delivered to the main thread when the block ran in another one. Outside a run (no owner installed),
:func:`deferred` installs a temporary owner for its block and afterwards acts on a noted signal as the
handler in force before would have.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM so every ``with`` block unwinds and reverts. A
    KeyboardInterrupt so that pytest and the CLI stop the whole run rather than fail one test."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum
        self.exit_code = 128 + signum


def interrupt_for(signum: int) -> KeyboardInterrupt:
    """What a signal becomes in the main thread: Ctrl-C is a KeyboardInterrupt, SIGTERM Terminated."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class SignalOwner:
    """SIGINT/SIGTERM handling for one process while installed (main thread only: Python runs
    handlers there). ``interrupted`` is the signal that interrupted the run, kept even when the
    raised exception is lost (Python prints and ignores one raised inside a finalizer)."""

    _installed: SignalOwner | None = None   # at most one owner holds the handlers at a time

    def __init__(self) -> None:
        self.interrupted: int | None = None
        self.finishing = False
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._depth = 0                    # open critical/deferred blocks, all threads
        self._pending: int | None = None   # a signal noted inside them, acted on when they end

    # -- lifetime ----------------------------------------------------------------------------------

    @classmethod
    def current(cls) -> SignalOwner | None:
        """The owner whose handlers are installed, if any."""
        return cls._installed

    @property
    def installed(self) -> bool:
        return SignalOwner._installed is self

    def install(self) -> SignalOwner:
        """From now on the first SIGINT or SIGTERM interrupts (or waits for the open blocks), later
        ones are noted. A no-op outside the main thread."""
        if _main_thread():
            for sig in HANDLED_SIGNALS:
                previous = signal.signal(sig, self._on_signal)
                self._previous.setdefault(sig, previous)
            SignalOwner._installed = self
        return self

    def finish(self) -> None:
        """The run only tears down and writes its report from here on: signals are noted only."""
        self.finishing = True

    def restore(self) -> None:
        """Give the handlers back. A finished run ignores further signals: pytest returns its exit
        code right after, and a Ctrl-C in that last instant must not turn a reported exit 0 into -2
        (Python resets Python-level handlers to the default while it shuts down; SIG_IGN stays)."""
        if SignalOwner._installed is self:
            SignalOwner._installed = None
        if not _main_thread():
            return
        for sig, previous in self._previous.items():
            if self.finishing:
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # -- the handler ---------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.finishing or self.interrupted is not None:
            log.warning("signal %s: the run already unwinds (signal %s) or reports; it finishes that first",
                        signum, self.interrupted)
            return
        with self._lock:
            if self._depth > 0:
                log.warning("signal %s received while a change or teardown must finish; acting on it after",
                            signum)
                if self._pending is None:
                    self._pending = signum
                return
        raise self._interrupt(signum)

    def _interrupt(self, signum: int) -> KeyboardInterrupt:
        if self.interrupted is None:
            self.interrupted = signum
        log.warning("signal %s: unwinding (every fault is reverted, every fixture torn down)", signum)
        return interrupt_for(signum)

    # -- blocks that make signals wait ---------------------------------------------------------------

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A change that must be whole: a signal waits until the outermost block ends, then interrupts
        (even when the block ends with an error: the user asked to stop)."""
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                signum = self._pending if self._depth == 0 else None
                if signum is not None:
                    self._pending = None
            if signum is not None and not self.finishing:
                self._act_on(signum)

    deferred = critical   # the same rule for a teardown that must finish; the name says which it is

    def _act_on(self, signum: int) -> None:
        if _main_thread():
            raise self._interrupt(signum)
        # handlers run in the main thread: deliver it there again, now that nothing waits for it
        signal.raise_signal(signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Signals wait until the block ends. Inside a run: the installed owner's :meth:`~SignalOwner.deferred`.
    Outside one: a temporary owner for the block; afterwards the first signal noted is acted on as the
    handler in force before would have (called, raised, or ignored under SIG_IGN)."""
    owner = SignalOwner.current()
    if owner is not None:
        with owner.deferred():
            yield
        return
    if not _main_thread():
        yield
        return
    temporary = _Temporary()
    try:
        yield
    finally:
        temporary.restore()
    temporary.act()


class _Temporary:
    """Handlers that only note signals, for one block outside a run."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.previous: dict[int, Any] = {sig: signal.signal(sig, self._note) for sig in HANDLED_SIGNALS}

    def _note(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def restore(self) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def act(self) -> None:
        if not self.received:
            return
        signum = self.received[0]
        log.warning("signal %s arrived during a teardown; acting on it now", signum)
        handler: Callable[[int, Any], Any] | int | None = self.previous.get(signum, signal.SIG_DFL)
        if callable(handler):
            handler(signum, None)
        elif handler != signal.SIG_IGN:
            raise interrupt_for(signum)


__all__ = ["HANDLED_SIGNALS", "SignalOwner", "Terminated", "deferred", "interrupt_for"]
