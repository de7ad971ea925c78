"""One memory budget for the bytes every session of a process has received and not delivered.

What a session holds: the coded bytes it received and has not decoded, and the decoded
output of the sections it started decoding and has not delivered (a decoded layer is up
to ~50x its coded size, so decoding ahead of the consumer is admitted against the budget
too: ``streamer.net.delivery``).

Each session already stops reading its socket above its own ``max_buffered_bytes``; a
receiver running hundreds of sessions at once would still hold hundreds of those. The
process's sessions share this budget too: while the total is over it, a session holding
more than its fair share (the budget over the sessions holding bytes) pauses reading, so
TCP holds the rest at the senders. Fair: a session under its share goes on reading, so a
new or small fetch is never starved by large ones. Never a deadlock: a session whose
consumer waits for bytes not yet read is never paused (its driver checks that first),
and when the total drops back under the budget every paused session is told to look
again.

A session looks after each socket read, so the sessions together may go past the budget
by what each reads before it looks (``READ_BYTES``, asyncio's and uvloop's largest read),
the chunk it is assembling and the decoded layer its consumer needs next: size the budget
with that in mind when sessions are many.

Pure bookkeeping on one event loop (the driver updates its holding after each read and
each delivery); no I/O, no threads.
"""
from __future__ import annotations

from typing import Callable

#: The default budget of a process: 512 MiB received and not yet delivered, across sessions.
DEFAULT_BUDGET_BYTES = 512 << 20
#: The most one socket read brings before the session can look (asyncio's and uvloop's
#: receive buffer): what each session may go past the budget by, with its chunk in assembly.
READ_BYTES = 256 << 10


class Share:
    """One session's part of a budget: what it holds, and a callback for when reading may
    resume."""

    def __init__(self, budget: "ReceiveBudget", wake: Callable[[], None]) -> None:
        self.budget, self.wake, self.held = budget, wake, 0
        #: the session stopped reading, or has sections waiting to decode: the budget
        #: wakes only those when it has room again
        self.paused = False
        self.waiting = False

    def hold(self, nbytes: int) -> None:
        """The share's session now holds ``nbytes`` received and not delivered."""
        self.budget._update(self, nbytes)

    def over(self) -> bool:
        """Whether the share's session should stop reading for the budget's sake: the
        process is over its budget and this share holds more than its fair part."""
        return self.budget.total > self.budget.limit and self.held > self.budget.fair_share()

    def close(self) -> None:
        self.budget._leave(self)


class ReceiveBudget:
    """The bytes a process's sessions may hold received and not delivered (``limit``)."""

    def __init__(self, limit: int = DEFAULT_BUDGET_BYTES) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"a receive budget is a positive number of bytes, got {limit!r}")
        self.limit = limit
        self.total = 0
        self.peak = 0
        self._shares: set[Share] = set()

    def join(self, wake: Callable[[], None]) -> Share:
        """A new session's share; ``wake`` is called when it may resume reading."""
        share = Share(self, wake)
        self._shares.add(share)
        return share

    def fair_share(self) -> int:
        """The budget over the sessions holding anything (at least one)."""
        holding = sum(1 for share in self._shares if share.held) or 1
        return self.limit // holding

    def _update(self, share: Share, nbytes: int) -> None:
        released = nbytes < share.held
        self.total += nbytes - share.held
        share.held = nbytes
        self.peak = max(self.peak, self.total)
        if released and self.total <= self.limit:
            for other in [s for s in self._shares if (s.paused or s.waiting) and s is not share]:
                other.wake()

    def _leave(self, share: Share) -> None:
        if share in self._shares:
            self._update(share, 0)
            self._shares.discard(share)


_process_budget = ReceiveBudget()


def process_budget() -> ReceiveBudget:
    """The budget every session of this process shares (``set_process_budget`` sizes it)."""
    return _process_budget


def set_process_budget(limit: int) -> ReceiveBudget:
    """Resize the process's budget (the receiver daemon does from its configuration); the
    sessions already running keep the one they joined."""
    global _process_budget
    _process_budget = ReceiveBudget(limit)
    return _process_budget
