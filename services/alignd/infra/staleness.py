"""How stale a rollout is, and the ``max_version_diff`` bound that drops or refuses it.

A rollout is generated with one weight version; the learner trains a newer one. TRACE bounds
the gap (``max_version_diff = 3``): a rollout whose version is more than ``N`` versions older
than the current one is not trained on.

Versions are string ids, so "N versions older" needs an order. It is the registry's
**creation order**: the distance from version ``v`` to the current version ``c`` is the
number of versions created after ``v`` up to and including ``c``
(:func:`versions_after`): 0 for the current version itself, 1 for the one before it. Versions
pruned since still count (the registry keeps the creation time of the newest pruned ids as
tombstones, :attr:`Registry.creation_keys <alignd.infra.registry.Registry.creation_keys>`),
so retention never makes an old rollout look fresh, and failed versions count too: every
version the learner published is a step it took. Two ``ZSCORE`` pairs and two ``ZCOUNT`` s,
two pipelined round trips, whatever the history holds. Versions created in the same
microsecond (the registry's clock) count as one instant.

Which version is current: the learner's newest published version (its loop knows it), and,
for the control API, which does not know the learner, the newest version in the registry
(the learner publishes every version it trains, so the two agree).

What happens beyond the bound is ``stale_rollouts``: ``drop`` (the batch is skipped, a
warning names both versions) or ``refuse`` (:class:`~alignclient.errors.StaleRolloutError`,
HTTP 409, naming both versions and the distance). Either way
``libalign_rollouts_stale_total{action="dropped"|"refused"}`` counts the rollouts.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from alignclient.errors import InputError, StaleRolloutError, VersionNotFoundError
from alignclient.ids import check_version_id

from alignd.infra.registry import Registry
from alignd.infra.telemetry import Metrics

log = logging.getLogger(__name__)

STALE_POLICIES = ("drop", "refuse")


def versions_after(registry: Registry, version_id: str,
                   current: str | None = None) -> tuple[int, str]:
    """``(n, current)``: ``n`` versions were created after ``version_id`` up to and including
    ``current`` (None: the registry's newest), negative when ``current`` is the older one.
    VersionNotFoundError naming a version neither the index nor the tombstones hold."""
    index, tombstones = registry.creation_keys
    client = registry.bus.client
    check_version_id(version_id)
    if current is None:
        newest = registry.bus.call("registry newest", lambda: client.zrevrange(index, 0, 0))
        current = newest[0] if newest else version_id
    check_version_id(current)

    def created() -> list[Any]:
        with client.pipeline(transaction=False) as pipe:
            for vid in (version_id, current):
                pipe.zscore(index, vid).zscore(tombstones, vid)
            return pipe.execute()

    a, b, c, d = registry.bus.call("registry creation times", created)
    times = []
    for vid, live, pruned in ((version_id, a, b), (current, c, d)):
        if live is None and pruned is None:
            raise VersionNotFoundError(vid, "registry index or its tombstones")
        times.append(float(live if live is not None else pruned))
    lo, hi = sorted(times)

    def count() -> list[int]:
        with client.pipeline(transaction=False) as pipe:
            for key in (index, tombstones):
                pipe.zcount(key, f"({lo!r}", repr(hi))
            return pipe.execute()

    n = sum(int(x) for x in registry.bus.call("registry versions between", count))
    return (n if times[1] >= times[0] else -n), current


class StalenessGuard:
    """Admits rollouts within ``max_version_diff`` versions of the current one; drops or refuses
    the others (``on_stale``), counting them. ``max_version_diff=None`` admits everything
    without a Redis call."""

    def __init__(self, registry: Registry, max_version_diff: int | None,
                 on_stale: Literal["drop", "refuse"] = "drop", metrics: Metrics | None = None):
        if max_version_diff is not None and max_version_diff < 0:
            raise InputError(f"max_version_diff must be >= 0 (or None), got {max_version_diff}")
        if on_stale not in STALE_POLICIES:
            raise InputError(f"stale_rollouts must be one of {STALE_POLICIES}, got {on_stale!r}")
        self.registry = registry
        self.max_version_diff = max_version_diff
        self.on_stale = on_stale
        self.metrics = metrics

    def admit(self, version_id: str, current: str | None = None, *, rollouts: int = 1) -> bool:
        """True if rollouts of ``version_id`` may be trained on against ``current`` (None: the
        registry's newest version); False if they are dropped; StaleRolloutError if refused.
        ``rollouts`` is how many the metric counts."""
        if self.max_version_diff is None:
            return True
        distance, current = versions_after(self.registry, version_id, current)
        if distance <= self.max_version_diff:
            return True
        action = "refused" if self.on_stale == "refuse" else "dropped"
        if self.metrics is not None:
            self.metrics.rollouts_stale.labels(action=action).inc(rollouts)
        if action == "refused":
            raise StaleRolloutError(version_id, current, distance, self.max_version_diff)
        log.warning("dropped %d rollout(s) of version %s: %d versions older than the current "
                    "%s (max_version_diff %d)", rollouts, version_id, distance, current,
                    self.max_version_diff)
        return False

    def describe(self) -> dict[str, Any]:
        """The rule as reported (status, heartbeats, the demo's summary)."""
        return {"max_version_diff": self.max_version_diff, "stale_rollouts": self.on_stale}
