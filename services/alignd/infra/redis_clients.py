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

Three kinds of real Redis, by the URL's scheme (:func:`parse_redis_url`):

* ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS, and every other form
  ``redis.Redis.from_url`` reads): one server;
* ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://``): a
  Redis Cluster, through redis-py's ``RedisCluster``; the hosts are seed nodes, any one of
  which is enough to find the others. It follows ``MOVED``/``ASK`` redirections itself and
  refreshes its slot map after a failover or a migration (that is routing, not retrying;
  connection errors still come up to :meth:`RedisBus.call`);
* ``redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db]``
  (``rediss+sentinel://``): the master a set of Sentinels names, through redis-py's
  ``Sentinel``; after a failover the next connection goes to the new master. The user and
  password are the data nodes'; the Sentinels are asked without credentials.

TLS options redis-py takes as keywords (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs``) may follow as query parameters of a cluster or Sentinel URL. No password
ever leaves this module in text: :class:`RedisAddress` prints as the URL with the password
replaced by ``***`` (:func:`redact_url`), and that is what log lines and errors name.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import parse_qsl, unquote

import redis
from alignclient.errors import ConfigError
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool
from redis.utils import HIREDIS_AVAILABLE

from alignd.infra.keyspace import CLUSTER_SCHEMES, SENTINEL_SCHEMES, url_scheme
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


#: Query parameters of a cluster or Sentinel URL passed on to redis-py (TLS options).
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_ca_path")


@dataclass(frozen=True)
class RedisAddress:
    """Where a Redis URL points: its kind, hosts, credentials and options.

    Prints (``str``, ``repr``) as the URL with the password replaced by ``***``.
    """

    kind: Literal["standalone", "cluster", "sentinel"]
    url: str = field(repr=False)
    hosts: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return redact_url(self.url)

    __repr__ = __str__


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: the only form of a Redis URL
    that may go into a log line, an error or a metric."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    at = rest.rfind("@", 0, rest.find("/") if "/" in rest else len(rest))
    if at < 0:
        return url
    userinfo = rest[:at]
    user = userinfo.split(":", 1)[0] if ":" in userinfo else userinfo
    hidden = f"{user}:***" if ":" in userinfo else user
    return f"{scheme}://{hidden}@{rest[at + 1:]}"


def _hosts(netloc: str, url: str) -> tuple[tuple[str, int], ...]:
    out = []
    for part in netloc.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"Redis URL {redact_url(url)}: expected host:port[,host:port...], "
                              f"got {part!r}")
        out.append((host.strip("[]"), int(port)))
    return tuple(out)


def parse_redis_url(url: str) -> RedisAddress:
    """Read a real server's URL (see the module docstring); ConfigError names what is wrong
    (never the password)."""
    scheme = url_scheme(url)
    if scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        return RedisAddress("standalone", url, tls=scheme == "rediss")
    rest = url.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    options = tuple((k, v) for k, v in parse_qsl(query) if k in TLS_OPTIONS)
    unknown = sorted({k for k, _ in parse_qsl(query)} - set(TLS_OPTIONS))
    if unknown:
        raise ConfigError(f"Redis URL {redact_url(url)}: unknown options {unknown}; a cluster "
                          f"or Sentinel URL takes {', '.join(TLS_OPTIONS)}")
    tls = scheme.startswith("rediss")
    hosts = _hosts(netloc, url)
    parts = [p for p in path.split("/") if p]
    if scheme in CLUSTER_SCHEMES:
        if parts:
            raise ConfigError(f"Redis URL {redact_url(url)}: a cluster has one database, "
                              "name no path after the hosts")
        return RedisAddress("cluster", url, hosts, None, 0, username, password, tls, options)
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(f"Redis URL {redact_url(url)}: expected "
                          f"{scheme}://host:port[,host:port...]/master-name[/db]")
    db = int(parts[1]) if len(parts) == 2 else 0
    return RedisAddress("sentinel", url, hosts, unquote(parts[0]), db, username, password, tls,
                        options)


def _net_options(addr: RedisAddress, socket_timeout_s: float) -> dict[str, Any]:
    kw: dict[str, Any] = {"socket_timeout": socket_timeout_s,
                          "socket_connect_timeout": min(2.0, socket_timeout_s)}
    if addr.tls:
        kw["ssl"] = True
        kw.update(dict(addr.options))
    return kw


def client_for(url: str | None, *, decode_responses: bool,
               socket_timeout_s: float) -> redis.Redis:
    """A client for ``url`` (None or ``embedded://NAME``: an embedded server), with no
    hidden retries.

    ``socket_timeout_s`` bounds every read from a real server (and connecting to it, at
    most 2 s); the embedded server has no sockets and ignores it. A cluster URL gives a
    ``RedisCluster`` (it answers the same commands; :func:`topology` tells them apart).
    """
    name = embedded_name(url)
    if name is not None:
        import fakeredis

        return fakeredis.FakeRedis(server=embedded_server(name), decode_responses=decode_responses,
                                   retry=Retry(NoBackoff(), 0))
    addr = parse_redis_url(url)
    if addr.kind == "standalone":
        return redis.Redis.from_url(
            url, decode_responses=decode_responses, socket_timeout=socket_timeout_s,
            socket_connect_timeout=min(2.0, socket_timeout_s), retry=Retry(NoBackoff(), 0),
        )
    net = _net_options(addr, socket_timeout_s)
    if addr.kind == "cluster":
        return RedisCluster(  # type: ignore[return-value]
            startup_nodes=[ClusterNode(h, p) for h, p in addr.hosts],
            username=addr.username, password=addr.password, decode_responses=decode_responses,
            retry=Retry(NoBackoff(), 0), **net)
    sentinel = Sentinel(list(addr.hosts), sentinel_kwargs=dict(net))
    return sentinel.master_for(addr.master, db=addr.db, username=addr.username,
                               password=addr.password, decode_responses=decode_responses,
                               retry=Retry(NoBackoff(), 0), **net)


def topology(client: Any) -> Literal["embedded", "standalone", "cluster", "sentinel"]:
    """Which kind of Redis ``client`` talks to."""
    if isinstance(client, RedisCluster):
        return "cluster"
    if is_embedded(client):
        return "embedded"
    if isinstance(client.connection_pool, SentinelConnectionPool):
        return "sentinel"
    return "standalone"


def decodes(client: Any) -> bool:
    """Whether ``client`` decodes replies to ``str`` (any kind of client)."""
    return bool(client.get_encoder().decode_responses)


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
    pool = getattr(client, "connection_pool", None)  # a RedisCluster has one pool per node
    cls = getattr(pool, "connection_class", None)
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
