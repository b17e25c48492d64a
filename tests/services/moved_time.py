"""Moving time in tests instead of waiting for it.

A test that sleeps past a TTL, an idle threshold or an interval races the host: on a loaded
machine the sleep may end before the server's clock crossed the line, or the code under test
may not get to run in time. Here time moves when the test says so:

* :class:`FakeClock` is a ``clock``/``now`` callable for the classes that take one (epoch or
  monotonic seconds, as the class expects); ``advance`` moves it.
* :func:`expire_now` does to keys what Redis does when their TTL runs out (``PEXPIREAT key
  1``: a deadline in the past removes the key at once), after the test checked that a TTL
  was set.
* :func:`age_pending` makes a pending stream entry look idle for ``idle_ms`` (``XCLAIM ...
  IDLE ms JUSTID`` to its own consumer: the owner and the delivery count stay as they were),
  what ``idle_ms`` of a dead consumer's silence would have done.
"""

from __future__ import annotations

import time

import redis


class FakeClock:
    """Seconds that move only when told (starts at ``start``, default ``time.time()``)."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock ``seconds`` forward; the new time."""
        self.now += seconds
        return self.now


def expire_now(client: redis.Redis, *keys: str | bytes) -> int:
    """Expire ``keys`` as if their TTL had run out; how many existed."""
    return sum(bool(client.pexpireat(k, 1)) for k in keys)


def age_pending(client: redis.Redis, stream: str, group: str, msg_id: str | bytes,
                idle_ms: int) -> None:
    """Make the pending entry ``msg_id`` idle for ``idle_ms``, owner and deliveries kept."""
    [entry] = client.xpending_range(stream, group, msg_id, msg_id, 1)
    owner = entry["consumer"]
    assert client.xclaim(stream, group, owner, 0, [msg_id], idle=idle_ms, justid=True)


def idle_ms(client: redis.Redis, stream: str, group: str, msg_id: str | bytes) -> int:
    """How long the pending entry ``msg_id`` has been idle, by the server's clock."""
    [entry] = client.xpending_range(stream, group, msg_id, msg_id, 1)
    return int(entry["time_since_delivered"])


def wait_until(cond, what: str, timeout_s: float = 10.0, poll_s: float = 0.005) -> None:
    """Poll ``cond`` until true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(poll_s)
