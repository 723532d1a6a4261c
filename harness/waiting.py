"""One way to wait for a condition: poll a callable until its value is accepted or time runs out.

Replaces the hand-written ``deadline = time.monotonic() + t; while ...: sleep`` loops. Built on
tenacity (stop after ``timeout_s``, a fixed ``interval_s`` between polls), so every wait in the
project has the same semantics:

* the callable is polled at least once, and again every ``interval_s`` until ``timeout_s`` has
  passed since the first poll (the last poll may land up to one interval after it);
* by default a truthy value ends the wait and is returned; ``accept=`` judges the value instead
  (for example ``accept=lambda s: s == "healthy"``), and the accepted value is returned as is,
  falsy or not;
* exceptions of the types in ``retry_on`` (for example ``httpx.HTTPError`` while a server starts)
  count as "not yet"; any other exception ends the wait at once and propagates unchanged;
* ``max_interval_s`` makes the interval grow (doubling from ``interval_s`` up to it) for waits that
  may be long and should not hammer what they poll (a restarting server's health URL);
* on time-out, :class:`WaitTimeoutError` names what was awaited, for how long, how many polls were
  made and the last value or exception seen. It is also a ``TimeoutError``, so callers that caught
  the loops' old ``TimeoutError`` keep working. ``on_timeout="return"`` is for best-effort waits
  ("wait up to 3 s for the worker to be busy, then go on anyway"): the last value is returned
  instead (None when the last poll raised one of ``retry_on``).

:func:`async_wait_until` is the same for coroutines (its callable may return a value or an
awaitable); it sleeps with ``asyncio.sleep`` so the event loop keeps running.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import logging
from typing import Any, Awaitable, Callable, Literal, TypeVar

from tenacity import (AsyncRetrying, RetryCallState, Retrying, retry_if_exception_type, retry_if_result,
                      stop_after_delay, wait_exponential, wait_fixed)

from harness.errors import HarnessError

log = logging.getLogger(__name__)

T = TypeVar("T")
OnTimeout = Literal["raise", "return"]

_MAX_SHOWN = 200  # characters of the last value kept in the error message


class WaitTimeoutError(HarnessError, TimeoutError):
    """A wait_until condition did not hold within its time-out."""

    def __init__(self, what: str, timeout_s: float, attempts: int, *, last_value: Any = None,
                 last_error: BaseException | None = None, fix: str | None = None) -> None:
        self.what, self.timeout_s, self.attempts = what, timeout_s, attempts
        self.last_value, self.last_error = last_value, last_error
        if last_error is not None:
            last = f"last error: {type(last_error).__name__}: {last_error}"
        else:
            shown = repr(last_value)
            last = f"last value: {shown if len(shown) <= _MAX_SHOWN else shown[:_MAX_SHOWN] + '...'}"
        super().__init__(f"timed out after {timeout_s:g} s waiting for {what} ({attempts} polls; {last})", fix=fix)


def _check(timeout_s: float, interval_s: float, what: str, max_interval_s: float | None, on_timeout: str) -> None:
    if not what:
        raise ValueError("wait_until needs what= (it names the wait in the time-out error)")
    if timeout_s < 0 or interval_s < 0:
        raise ValueError(f"wait_until({what!r}): timeout_s and interval_s must be >= 0, "
                         f"got {timeout_s} and {interval_s}")
    if max_interval_s is not None and max_interval_s < interval_s:
        raise ValueError(f"wait_until({what!r}): max_interval_s ({max_interval_s}) is below interval_s ({interval_s})")
    if on_timeout not in ("raise", "return"):
        raise ValueError(f"wait_until({what!r}): on_timeout must be 'raise' or 'return', got {on_timeout!r}")


def _retrying_kwargs(timeout_s: float, interval_s: float, what: str, accept: Callable[[Any], bool] | None,
                     retry_on: tuple[type[BaseException], ...], fix: str | None, max_interval_s: float | None,
                     on_timeout: str) -> dict[str, Any]:
    _check(timeout_s, interval_s, what, max_interval_s, on_timeout)
    judge: Callable[[Any], bool] = accept if accept is not None else bool

    def give_up(state: RetryCallState) -> Any:
        outcome = state.outcome
        assert outcome is not None  # tenacity calls this only after an attempt
        if on_timeout == "return":
            log.debug("gave up waiting for %s after %g s (%d polls)", what, timeout_s, state.attempt_number)
            return None if outcome.failed else outcome.result()
        if outcome.failed:
            raise WaitTimeoutError(what, timeout_s, state.attempt_number, last_error=outcome.exception(),
                                   fix=fix) from outcome.exception()
        raise WaitTimeoutError(what, timeout_s, state.attempt_number, last_value=outcome.result(), fix=fix)

    retry = retry_if_result(lambda value: not judge(value))
    if retry_on:
        retry = retry | retry_if_exception_type(retry_on)
    wait = (wait_fixed(interval_s) if max_interval_s is None else
            wait_exponential(multiplier=interval_s, min=interval_s, max=max_interval_s))
    return dict(stop=stop_after_delay(timeout_s), wait=wait, retry=retry, retry_error_callback=give_up)


def wait_until(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.1, *, what: str,
               accept: Callable[[T], bool] | None = None, retry_on: tuple[type[BaseException], ...] = (),
               fix: str | None = None, max_interval_s: float | None = None, on_timeout: OnTimeout = "raise",
               sleep: Callable[[float], None] = time.sleep) -> T:
    """Poll ``predicate()`` until its value is accepted (truthy by default); return that value.

    Raises WaitTimeoutError (naming ``what``, the polls made and the last value or exception) when
    ``timeout_s`` passes first, or returns the last value with ``on_timeout="return"``. ``sleep``
    is for callers that must sleep differently (a test; ``gevent.sleep`` in a Locust process)."""
    kwargs = _retrying_kwargs(timeout_s, interval_s, what, accept, retry_on, fix, max_interval_s, on_timeout)
    return Retrying(sleep=sleep, **kwargs)(predicate)


async def async_wait_until(predicate: Callable[[], T | Awaitable[T]], timeout_s: float, interval_s: float = 0.1,
                           *, what: str, accept: Callable[[T], bool] | None = None,
                           retry_on: tuple[type[BaseException], ...] = (), fix: str | None = None,
                           max_interval_s: float | None = None, on_timeout: OnTimeout = "raise") -> T:
    """wait_until for event-loop code: ``predicate`` may be a plain or an async callable."""
    kwargs = _retrying_kwargs(timeout_s, interval_s, what, accept, retry_on, fix, max_interval_s, on_timeout)

    async def poll() -> T:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        return value  # type: ignore[return-value]

    return await AsyncRetrying(sleep=asyncio.sleep, **kwargs)(poll)


__all__ = ["WaitTimeoutError", "async_wait_until", "wait_until"]
