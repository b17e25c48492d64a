"""Redis clients from service settings: a real server at ``redis_url``, or the embedded one.

Every service reaches Redis through a client made here, so there is exactly one answer
to "which Redis, with which options". Two flavours exist because Redis replies are
bytes and the callers want different things:

* :func:`text_client` decodes replies to ``str`` (``decode_responses=True``). The event
  bus (:class:`~alignd.infra.bus.RedisBus`) and the version registry use it:
  they only handle ids, JSON and stream fields.
* :func:`binary_client` returns raw ``bytes`` (``decode_responses=False``). The guidance
  store needs it: its records are arbitrary bytes that no codec may touch.

redis-py parses replies with ``hiredis`` (a C parser, in the ``daemon`` extra) whenever it
is installed; :func:`reply_parser` says which parser is in use. For multi-megabyte
guidance records it is what keeps the store close to the server's own speed.

With ``settings.redis_url`` set, a client connects to that server with short connect
timeouts and no retries hidden inside redis-py: :meth:`RedisBus.call` retries
connection errors itself, with backoff, a give-up budget and metrics, and a second,
invisible retry layer underneath would only multiply waits and duplicate writes.

With ``redis_url`` unset (``None``, the default) the clients talk to the **embedded**
server: one in-process, Redis-compatible server (``fakeredis.FakeServer``) per Python
process, created on first use and shared by every client made here afterwards. It
speaks the commands the daemon uses (strings, hashes, sets, sorted sets, Streams with
consumer groups and ``XAUTOCLAIM``, ``MULTI``/``EXEC``, Lua with ``cjson``, key expiry),
so the same code path runs with zero setup.

An embedded server has a name. ``redis_url`` unset is the process's ``default`` server;
``embedded://NAME`` names another one, created on first use. :func:`run_namespace` gives a run
a private, freshly named server and drops it when the run ends, so two runs in one process, one
after the other or at once, never see each other's keys (``alignd demo`` runs every
configuration so); :func:`embedded_names` lists the servers a process holds.

What the embedded mode is for: the README's zero-setup path, where ``alignd`` runs the
API, converter, sampler and learner as threads of *one* process on a laptop, and quick
experiments and tests of logic that does not care where Redis lives.

What it is not:

* not persistent: everything is gone when the process exits;
* not shared across processes: a second process (another ``alignd``, a converter
  started on its own, ``redis-cli``) gets its own, empty server and sees none of the
  first one's versions, events or guidance. Run services as separate processes only
  with ``ALIGN_REDIS_URL`` pointing at a real Redis;
* not for fault tests: it cannot be stopped, restarted, lose its data or its
  connections the way a real server can, and nothing crosses a socket. Tests of
  retries, crashes and restarts run against a real ``redis-server``;
* not a server to measure speed on: its commands run in Python, one at a time under
  one lock. That is plenty for one process's control traffic and guidance records
  (hundreds of MB/s for MB-sized records, tens of MB/s for 10 KB ones), but it says
  nothing about a deployment.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE

from alignd.infra.settings import ServiceSettings

if TYPE_CHECKING:  # fakeredis is imported on first use: a deployment never pays for it
    import fakeredis

S = TypeVar("S", bound=ServiceSettings)

#: Socket timeout of text clients (the bus adds its own longest blocking read).
TEXT_TIMEOUT_S = 10.0
#: Socket timeout of binary clients: a 256 MB guidance record takes a while to move.
BINARY_TIMEOUT_S = 30.0

#: Scheme of a named embedded server's URL: ``embedded://NAME``.
EMBEDDED_SCHEME = "embedded://"
#: Name of the server ``redis_url`` unset selects.
DEFAULT_EMBEDDED = "default"

_lock = threading.Lock()
_servers: dict[str, fakeredis.FakeServer] = {}


def embedded_name(url: str | None) -> str | None:
    """The embedded server ``url`` selects (None: ``default``), or None for a real server."""
    if url is None:
        return DEFAULT_EMBEDDED
    if url.startswith(EMBEDDED_SCHEME):
        name = url[len(EMBEDDED_SCHEME):]
        if not name or "/" in name:
            raise ValueError(f"embedded Redis URL {url!r}: expected embedded://NAME")
        return name
    return None


def embedded_server(name: str = DEFAULT_EMBEDDED) -> fakeredis.FakeServer:
    """The embedded server called ``name``, created on the first call (thread-safe)."""
    with _lock:
        server = _servers.get(name)
        if server is None:
            import fakeredis

            server = _servers[name] = fakeredis.FakeServer()
        return server


def embedded_names() -> list[str]:
    """The embedded servers this process holds, by name."""
    with _lock:
        return sorted(_servers)


def release_embedded(name: str) -> None:
    """Drop the embedded server ``name`` and its keys; clients made before keep talking to
    the dropped server (which nobody else reaches) until they are dropped."""
    with _lock:
        _servers.pop(name, None)


def reset_embedded() -> None:
    """Forget the default embedded server; the next client gets a new, empty one (for tests)."""
    release_embedded(DEFAULT_EMBEDDED)


@contextmanager
def run_namespace(settings: S) -> Iterator[S]:
    """``settings`` on a private embedded server for the length of a run.

    On the embedded default, the settings yielded name a freshly created server
    (``embedded://run-<random>``), dropped with every key on it when the block ends, however it
    ends: whatever the run left behind, a later or concurrent run never reads it. Settings for a
    real Redis come back unchanged: there, ``key_prefix`` separates runs.
    """
    if embedded_name(settings.redis_url) is None:
        yield settings
        return
    name = f"run-{uuid.uuid4().hex[:12]}"
    embedded_server(name)
    try:
        yield settings.model_copy(update={"redis_url": EMBEDDED_SCHEME + name})
    finally:
        release_embedded(name)


def client_for(url: str | None, *, decode_responses: bool,
               socket_timeout_s: float) -> redis.Redis:
    """A client for ``url`` (None or ``embedded://NAME``: an embedded server), with no
    hidden retries.

    ``socket_timeout_s`` bounds every read from a real server (and connecting to it, at
    most 2 s); the embedded server has no sockets and ignores it.
    """
    name = embedded_name(url)
    if name is not None:
        import fakeredis

        return fakeredis.FakeRedis(server=embedded_server(name), decode_responses=decode_responses,
                                   retry=Retry(NoBackoff(), 0))
    return redis.Redis.from_url(
        url, decode_responses=decode_responses, socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(2.0, socket_timeout_s), retry=Retry(NoBackoff(), 0),
    )


def text_client(settings: ServiceSettings, *, socket_timeout_s: float = TEXT_TIMEOUT_S) -> redis.Redis:
    """A client whose replies are ``str``: for the bus, the registry and other metadata."""
    return client_for(settings.redis_url, decode_responses=True,
                      socket_timeout_s=socket_timeout_s)


def binary_client(settings: ServiceSettings, *,
                  socket_timeout_s: float = BINARY_TIMEOUT_S) -> redis.Redis:
    """A client whose replies are ``bytes``: for the guidance store's records."""
    return client_for(settings.redis_url, decode_responses=False,
                      socket_timeout_s=socket_timeout_s)


def is_embedded(client: redis.Redis) -> bool:
    """True if ``client`` talks to an in-process fakeredis server, not over a socket."""
    cls = client.connection_pool.connection_class
    return getattr(cls, "__module__", "").startswith("fakeredis")


def reply_parser() -> str:
    """``"hiredis"`` when redis-py parses replies with hiredis (it is installed), else ``"python"``."""
    return "hiredis" if HIREDIS_AVAILABLE else "python"


def payload_pool(client: redis.Redis) -> redis.ConnectionPool:
    """A second connection pool to ``client``'s server, with the same connection options.

    For exchanges that hold a connection while megabytes move (the guidance store's
    payloads), kept apart from the client's own connections. The options come from the
    public ``connection_kwargs``, less the entries a pool adds there for connections of its
    own (found by asking a bare pool of the same connection class): the new pool adds its own.
    """
    pool = client.connection_pool
    cls = pool.connection_class
    own = redis.ConnectionPool(connection_class=cls).connection_kwargs
    return redis.ConnectionPool(connection_class=cls, **{
        k: v for k, v in pool.connection_kwargs.items() if k not in own})
