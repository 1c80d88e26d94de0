"""Deadlines: the timeouts of every request the router serves, kept by one periodic tick (every ``TICK_S``)
instead of a timer each.

Why: a P/D request had three timers (its whole deadline, its prefill leg's, its stream's stall watch), and each
timer is an entry pushed into and cancelled out of the event loop's heap, compared by a Python method: ~4% of
the router's CPU per request (``bench/router.py``). These deadlines are seconds to minutes long, so a tick of
50 ms is precise enough; the tick runs only while some deadline is kept.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Protocol

TICK_S = 0.05


class Due(Protocol):
    """One kept deadline: ``due(now)`` runs at the first tick at or after ``when`` (it may move ``when`` later to
    be kept on, or drop itself)."""

    when: float

    def due(self, now: float) -> None: ...


class Deadlines:
    def __init__(self) -> None:
        self._kept: set[Due] = set()
        self._tick: asyncio.TimerHandle | None = None

    def keep(self, entry: Due) -> None:
        self._kept.add(entry)
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(TICK_S, self._run)

    def drop(self, entry: Due) -> None:
        self._kept.discard(entry)

    def timeout(self, seconds: float) -> Timeout:
        """Like ``asyncio.timeout(seconds)``: TimeoutError out of the block once ``seconds`` passed (to a tick)."""
        return Timeout(self, seconds)

    def _run(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for entry in [entry for entry in self._kept if entry.when <= now]:
            entry.due(now)
        self._tick = loop.call_later(TICK_S, self._run) if self._kept else None


class Timeout:
    """An ``async with`` block's deadline: cancels the task at its deadline and turns that cancellation, and only
    that one, into TimeoutError (as ``asyncio.timeout`` does)."""

    __slots__ = ("_cancelling", "_deadlines", "_seconds", "_task", "expired", "when")

    def __init__(self, deadlines: Deadlines, seconds: float) -> None:
        self.when = 0.0
        self._deadlines = deadlines
        self._seconds = seconds
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self.expired = False

    async def __aenter__(self) -> Timeout:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Timeout outside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self.when = asyncio.get_running_loop().time() + self._seconds
        self._deadlines.keep(self)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._deadlines.drop(self)
        if self.expired and kind is asyncio.CancelledError:
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling:
                raise TimeoutError from error

    def due(self, now: float) -> None:
        self._deadlines.drop(self)
        if self._task is not None and not self._task.done():
            self.expired = True
            self._task.cancel()
