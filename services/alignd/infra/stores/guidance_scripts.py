"""The guidance store's key layout and the Lua scripts that keep its accounting.

Key layout (``P`` is ``<key_prefix>:guidance``, ``v`` a version id, ``r`` a rollout id,
``g`` the generation of one put, ``i`` a chunk number)::

    P:index                  zset   v -> order of its first put (oldest first)
    P:seq                    string counter behind that order
    P:bytes                  hash   v -> payload bytes the version holds
    P:total                  string payload bytes of all versions (the budget's measure)
    P:deadline               hash   v -> deadline_ms, when its TTL runs out (0: no TTL)
    P:lost                   zset   v -> when it was found lost (the newest 10,000; no TTL)
    P:v:<v>                  hash   created (server time), seq, deadline_ms (0: no TTL)
    P:v:<v>:rollouts         set    rollout ids of the version
    P:v:<v>:r:<r>            hash   len, n (chunks), cs (chunk size), gen, crc, created
    P:v:<v>:c:<r>:<g>:<i>    string chunk i of generation g (at most ``chunk_bytes``)
    P:v:<v>:lessees          set    consumers that took a lease on the version
    P:v:<v>:lease:<c>        string one consumer's lease, expiring by itself (PX)
    P:tomb:<v>               string JSON: when and why the version was evicted (EX a day)

This layout is the stored format: stores written by earlier releases read with it, so a
change here is a migration. Python builds these names in :class:`GuidanceKeys`; the Lua
helpers (``guidance_common.lua``) build the same ones inside Redis.

Why Lua. Every change to the accounting (``P:total`` equal to the sum of ``P:bytes``,
``P:index`` naming exactly the versions that exist) reads and writes several keys, and
Redis runs one script with no other command in between. So concurrent puts, evictions,
expiries and deletions can never leave the totals off. Keys are computed inside the
scripts, which is why the store needs one Redis (standalone or Sentinel), not Cluster.

Why reconcile first. With a TTL every key of a version expires at one moment, and Redis
deletes expired keys by itself without telling anybody. So every script that reads the
accounting first drops versions whose ``P:v:<v>`` is gone and leaves a tombstone for them.
``P:deadline`` (no TTL of its own) keeps each version's deadline after its keys are gone, so
the tombstone tells why: gone at or after the deadline, the version *expired*; gone before
it (or without a TTL at all) it was *lost*: a server under a ``maxmemory-policy`` other than
``noeviction`` evicted it, or something outside the store deleted it. Every script's reply
names the versions it found gone, with the cause, so the store counts and logs each once
(versions written before ``P:deadline`` existed are reported with the cause ``unknown``).
``P:lost`` remembers lost versions after their tombstone (which has a TTL, and which a
``volatile-*`` policy evicts first) is gone, so a reader is still told "lost".

The scripts live beside this module as ``guidance_<name>.lua`` (shipped as package data),
one file each with its arguments and reply written at its top; :func:`source` prepends
``guidance_common.lua`` (the helpers and the KEYS/ARGV conventions every script shares).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources

#: The scripts, ``guidance_<name>.lua`` (each starts with ``guidance_common.lua``).
SCRIPTS = ("commit", "reconcile", "delete", "acquire", "release", "list")


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(f"guidance_{name}.lua").read_text()


@cache
def source(name: str) -> str:
    """The full text of script ``name`` (one of :data:`SCRIPTS`): the helpers, then its body."""
    if name not in SCRIPTS:
        raise ValueError(f"no guidance script {name!r}; there are {', '.join(SCRIPTS)}")
    return _read("common") + _read(name)


@dataclass(frozen=True)
class GuidanceKeys:
    """Redis key names of one store, ``prefix`` being ``P`` (``<key_prefix>:guidance``)."""

    prefix: str

    @property
    def script_keys(self) -> list[str]:
        """KEYS of every script: P:index, P:bytes, P:total, P:seq, P:deadline."""
        return [f"{self.prefix}:{k}" for k in ("index", "bytes", "total", "seq", "deadline")]

    def version(self, v: str) -> str:
        return f"{self.prefix}:v:{v}"

    def rollouts(self, v: str) -> str:
        return f"{self.prefix}:v:{v}:rollouts"

    def rollout(self, v: str, r: str) -> str:
        return f"{self.prefix}:v:{v}:r:{r}"

    def chunk(self, v: str, r: str, gen: str, i: int) -> bytes:
        return f"{self.prefix}:v:{v}:c:{r}:{gen}:{i}".encode()

    def tombstone(self, v: str) -> str:
        return f"{self.prefix}:tomb:{v}"

    @property
    def lost(self) -> str:
        return f"{self.prefix}:lost"
