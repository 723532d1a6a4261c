"""wait_until / async_wait_until: what they return, when they stop, what their time-out error says.

No timing thresholds: the waits use interval 0 (or a recording fake sleep) and count the polls."""

from __future__ import annotations

import asyncio

import pytest

from harness.errors import HarnessError
from harness.waiting import WaitTimeoutError, async_wait_until, wait_until


class Counter:
    """A callable returning the given values in turn (the last one repeated), counting its calls."""

    def __init__(self, *values):
        self.values, self.calls = list(values), 0

    def __call__(self):
        self.calls += 1
        value = self.values[min(self.calls, len(self.values)) - 1]
        if isinstance(value, BaseException):
            raise value
        return value


def test_returns_the_first_truthy_value_and_stops_polling():
    poll = Counter(None, 0, {"state": "up"}, "never reached")
    assert wait_until(poll, 30, 0, what="the server") == {"state": "up"}
    assert poll.calls == 3


def test_accept_judges_the_value_and_a_falsy_accepted_value_is_returned():
    poll = Counter(3, 2, 1, 0, -1)
    assert wait_until(poll, 30, 0, what="the queue to drain", accept=lambda n: n == 0) == 0
    assert poll.calls == 4


def test_sleeps_the_interval_between_polls_only():
    slept = []
    poll = Counter(False, False, True)
    assert wait_until(poll, 30, 0.25, what="x", sleep=slept.append) is True
    assert slept == [0.25, 0.25]


def test_timeout_zero_polls_exactly_once_and_names_what_and_the_last_value():
    poll = Counter({"level": 1})
    with pytest.raises(WaitTimeoutError) as err:
        wait_until(poll, 0, 0, what="degradation level 2", accept=lambda s: s["level"] >= 2, fix="raise the load")
    assert poll.calls == 1
    e = err.value
    assert (e.what, e.attempts, e.last_value, e.last_error) == ("degradation level 2", 1, {"level": 1}, None)
    assert "degradation level 2" in str(e) and "{'level': 1}" in str(e) and "fix: raise the load" in str(e)
    assert isinstance(e, TimeoutError) and isinstance(e, HarnessError)


def test_times_out_after_several_polls_when_never_true():
    poll = Counter(False)
    with pytest.raises(WaitTimeoutError) as err:
        wait_until(poll, 0.02, 0.001, what="never")
    assert poll.calls >= 1 and err.value.attempts == poll.calls
    assert "last value: False" in str(err.value)


def test_retry_on_exceptions_count_as_not_yet():
    poll = Counter(ConnectionError("refused"), ConnectionError("refused"), "ok")
    assert wait_until(poll, 30, 0, what="the API", retry_on=(ConnectionError,)) == "ok"
    assert poll.calls == 3


def test_other_exceptions_propagate_at_once_unchanged():
    poll = Counter(ConnectionError("refused"), KeyError("boom"), "ok")
    with pytest.raises(KeyError, match="boom"):
        wait_until(poll, 30, 0, what="the API", retry_on=(ConnectionError,))
    assert poll.calls == 2


def test_timeout_names_the_last_exception_seen():
    poll = Counter(ConnectionError("connection refused on :8000"))
    with pytest.raises(WaitTimeoutError) as err:
        wait_until(poll, 0, 0, what="the API", retry_on=(ConnectionError,))
    assert isinstance(err.value.last_error, ConnectionError)
    assert isinstance(err.value.__cause__, ConnectionError)
    assert "ConnectionError: connection refused on :8000" in str(err.value)


def test_a_long_last_value_is_shortened_in_the_message():
    with pytest.raises(WaitTimeoutError) as err:
        wait_until(lambda: "x" * 10_000, 0, 0, what="y", accept=lambda v: False)
    assert len(str(err.value)) < 400 and err.value.last_value == "x" * 10_000


@pytest.mark.parametrize("kwargs, needle", [({"what": ""}, "what="), ({"what": "w", "timeout_s": -1}, ">= 0")])
def test_bad_arguments_are_refused_before_polling(kwargs, needle):
    poll = Counter(True)
    args = {"timeout_s": 1, **kwargs}
    with pytest.raises(ValueError, match=needle):
        wait_until(poll, args.pop("timeout_s"), 0, **args)
    assert poll.calls == 0


def test_async_polls_plain_and_async_callables():
    plain = Counter(0, 0, 5)
    states = iter(["starting", "starting", "healthy"])
    calls = []

    async def health():
        calls.append(1)
        await asyncio.sleep(0)
        return next(states)

    async def main():
        a = await async_wait_until(plain, 30, 0, what="plain")
        b = await async_wait_until(health, 30, 0, what="health", accept=lambda s: s == "healthy")
        return a, b

    assert asyncio.run(main()) == (5, "healthy")
    assert plain.calls == 3 and len(calls) == 3


def test_async_timeout_and_retry_on():
    poll = Counter(OSError("down"))

    async def main():
        await async_wait_until(poll, 0, 0, what="the worker", retry_on=(OSError,))

    with pytest.raises(WaitTimeoutError, match="the worker.*OSError: down"):
        asyncio.run(main())
    assert poll.calls == 1


def test_max_interval_doubles_the_pause_up_to_the_cap():
    slept = []
    poll = Counter(False, False, False, False, False, True)
    assert wait_until(poll, 30, 0.05, what="x", max_interval_s=0.15, sleep=slept.append) is True
    assert slept == [0.05, 0.1, 0.15, 0.15, 0.15]


def test_on_timeout_return_gives_the_last_value_instead_of_raising():
    poll = Counter(3, 2)
    assert wait_until(poll, 0, 0, what="x", accept=lambda n: n == 0, on_timeout="return") == 3
    failing = Counter(OSError("down"))
    assert wait_until(failing, 0, 0, what="x", retry_on=(OSError,), on_timeout="return") is None


@pytest.mark.parametrize("kwargs, needle", [({"max_interval_s": 0.01}, "below interval_s"),
                                            ({"on_timeout": "ignore"}, "on_timeout")])
def test_bad_options_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        wait_until(lambda: True, 1, 0.1, what="x", **kwargs)
