"""What the daemon requires of its Redis server, and the errors no retry can fix: one home.

The daemon keeps all of its state in Redis: the version registry and its index, the event
streams, the guidance store, rollouts, heartbeats. Two things about the server decide whether
that state is safe, and neither shows until it is too late unless somebody checks:

* **Eviction.** A server with ``maxmemory`` and any ``maxmemory-policy`` but ``noeviction``
  deletes keys by itself when it is full, and tells nobody: a version record, a stream, a
  guidance chunk vanish while every write was answered OK. The ``volatile-*`` policies are no
  safer: the daemon sets TTLs on guidance records and rollouts, so those are exactly the keys
  they evict. Only ``noeviction`` keeps every key; a full server then refuses writes (OOM),
  which the daemon reports (:func:`refusal`) instead of losing data.
* **Credentials.** A wrong password, a missing one, or an ACL user who may not run the
  commands the daemon uses is a configuration error: no retry fixes it.

:func:`check_server` is the check, written against any ``redis.Redis`` client so that the
same function checks a standalone server, a Sentinel-managed master or each node of a Cluster.
It reads the policy with ``CONFIG GET maxmemory-policy`` and, where an ACL or a managed service
refuses CONFIG, from ``INFO memory`` (``maxmemory_policy``); when neither can be read it refuses
too, unless the operator allows it (``ALIGN_REDIS_ALLOW_UNVERIFIED_POLICY``: a loud warning,
counted in ``libalign_redis_policy_unverified_total``). It then runs one probe script that
writes, streams and deletes a key under the key prefix, so a user whose ACL lacks scripting,
writes, streams or the prefix's key pattern is told at start, not at the first publish. Every
service process runs it when it starts (:func:`alignd.infra.service_main.load_settings`) and
exits with status 2 when it refuses; the embedded in-process server never evicts and has no
users, so it is not checked.

:func:`refusal` turns a Redis error that retrying cannot fix into the daemon's typed error,
and counts it in ``libalign_redis_refusals_total{reason}``:

* ``oom``: a full ``noeviction`` server refused a write (``OOM command not allowed when used
  memory > 'maxmemory'``): a :class:`~alignclient.errors.RedisFullError` (HTTP 507) that says
  "Redis is full".
  A refused command writes nothing; a transaction (``MULTI``/``EXEC``) is refused whole and a
  script is refused at its first write, so the daemon's atomic writes are never half-done;
* ``auth`` (``WRONGPASS``, ``NOAUTH``, a refused ``AUTH``/``HELLO``) and ``noperm`` (``NOPERM``,
  or a script's command the user may not run): a :class:`~alignclient.errors.ConfigError`.
  redis-py raises bad credentials as a kind of connection error;
  :meth:`alignd.infra.bus.RedisBus.call` asks :data:`CREDENTIAL_ERRORS` and does not retry them.

No message here carries a password: a server is named by host, port, database and user.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import redis
from alignclient.errors import AlignError, ConfigError, RedisFullError

from alignd.infra.redis_clients import is_embedded, topology
from alignd.infra.telemetry import REDIS_POLICY_UNVERIFIED, REDIS_REFUSALS

log = logging.getLogger(__name__)

#: The one ``maxmemory-policy`` under which Redis never deletes a key by itself.
REQUIRED_POLICY = "noeviction"
#: What an operator does about an evicting server.
POLICY_FIX = ("Set maxmemory-policy noeviction on the Redis server (redis.conf, "
              "--maxmemory-policy noeviction, or CONFIG SET maxmemory-policy noeviction)")

#: redis-py's errors for credentials the server refused (subclasses of its ConnectionError).
CREDENTIAL_ERRORS = (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)

#: How Redis words a script's command (or key) that the ACL user may not use (before 7.2 the
#: reply carries no NOPERM code).
_SCRIPT_NOPERM = ("can't run this command", "no permissions to access")
#: How Redis words a refused write on a full server (redis-py strips the OOM code).
_OOM_TEXT = "command not allowed when used memory > 'maxmemory'"

#: The probe: scripting, a write with a TTL, a stream entry and deletes, on two keys under the
#: key prefix. The TTLs remove the keys even if a refused command stops the script half-way.
_PROBE_LUA = """
redis.call('TIME')
redis.call('SET', KEYS[1], '1', 'PX', 60000)
redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'probe', '1')
redis.call('PEXPIRE', KEYS[2], 60000)
return redis.call('DEL', KEYS[1], KEYS[2])
"""


@dataclass(frozen=True)
class EvictionPolicy:
    """A server's ``maxmemory-policy`` (None: unreadable) and where it was read (or why not)."""

    policy: str | None
    source: str

    @property
    def evicts(self) -> bool:
        """Whether the server may delete keys by itself (an unreadable policy is not known to)."""
        return self.policy is not None and self.policy != REQUIRED_POLICY


def server_name(client: redis.Redis) -> str:
    """The server ``client`` talks to, as ``host:port/db`` with its user: never a password.

    A cluster is named by its nodes, a Sentinel-managed master by its name and Sentinels."""
    kind = topology(client)
    if kind == "cluster":
        nodes = ", ".join(n.name for n in client.get_nodes()[:6])
        return f"Redis Cluster of {nodes}{', ...' if len(client.get_nodes()) > 6 else ''}"
    if kind == "sentinel":
        pool = client.connection_pool
        kws = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
        seen = ", ".join(f"{kw.get('host', '?')}:{kw.get('port', '?')}" for kw in kws)
        user = pool.connection_kwargs.get("username") or "default"
        return f"Redis master {pool.service_name!r} of the Sentinels at {seen} (user {user!r})"
    kw = client.connection_pool.connection_kwargs
    where = (f"{kw['host']}:{kw.get('port', 6379)}" if "host" in kw
             else str(kw.get("path", "a socket")))
    user = kw.get("username") or "default"
    secret = "with a password" if kw.get("password") else "without a password"
    return f"Redis at {where}/{kw.get('db', 0)} (user {user!r}, {secret})"


def _said(error: BaseException) -> str:
    """What the server said, without a closing full stop (the message goes on)."""
    return str(error).rstrip(". ")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_eviction_policy(client: redis.Redis) -> EvictionPolicy:
    """The server's ``maxmemory-policy``: from ``CONFIG GET``, else from ``INFO memory``.

    A refusal of either (an ACL, a renamed or disabled CONFIG) is noted in ``source``; bad
    credentials and connection errors propagate.
    """
    if is_embedded(client):
        return EvictionPolicy(REQUIRED_POLICY, "the embedded server, which never evicts")
    refused: list[str] = []
    try:
        reply = client.config_get("maxmemory-policy")
        value = reply.get("maxmemory-policy", reply.get(b"maxmemory-policy"))
        if value:
            return EvictionPolicy(_text(value), "CONFIG GET maxmemory-policy")
        refused.append("CONFIG GET maxmemory-policy answered nothing")
    except redis.exceptions.ResponseError as e:
        refused.append(f"CONFIG GET refused: {e}")
    try:
        value = client.info("memory").get("maxmemory_policy")
        if value:
            return EvictionPolicy(_text(value), "INFO memory")
        refused.append("INFO memory has no maxmemory_policy")
    except redis.exceptions.ResponseError as e:
        refused.append(f"INFO refused: {e}")
    return EvictionPolicy(None, "; ".join(refused))


def _is_noperm(error: BaseException) -> bool:
    if isinstance(error, redis.exceptions.NoPermissionError):
        return True
    text = str(error).lower()
    return isinstance(error, redis.exceptions.ResponseError) and any(
        m in text for m in _SCRIPT_NOPERM)


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, redis.exceptions.OutOfMemoryError) or (
        isinstance(error, redis.exceptions.ResponseError) and _OOM_TEXT in str(error))


def refusal(error: BaseException, what: str) -> AlignError | None:
    """The typed error for a Redis error no retry can fix (counted), or None for any other.

    ``what`` names the operation (``"registry create v3"``) for the message.
    """
    if isinstance(error, CREDENTIAL_ERRORS):
        REDIS_REFUSALS.labels(reason="auth").inc()
        return ConfigError(
            f"{what}: Redis refused the credentials: {_said(error)}. Check the user and "
            "password in ALIGN_REDIS_URL (redis://user:password@host:port/db); bad credentials "
            "are a configuration error and are not retried")
    if _is_noperm(error):
        REDIS_REFUSALS.labels(reason="noperm").inc()
        return ConfigError(
            f"{what}: the Redis user may not run a command the daemon needs: {_said(error)}. Grant "
            "it scripting, reads, writes and streams on the key prefix's keys (ACL SETUSER)")
    if _is_oom(error):
        REDIS_REFUSALS.labels(reason="oom").inc()
        return RedisFullError(
            f"Redis is full: OOM command not allowed when used memory > 'maxmemory' ({what}); "
            "the command was refused and wrote nothing. Free memory (delete old versions, "
            "lower the guidance budget or the TTLs) or raise maxmemory")
    return None


def probe_commands(client: redis.Redis, key_prefix: str) -> None:
    """Run the probe script (see :data:`_PROBE_LUA`) on keys under ``key_prefix``; a refusal
    raises (credentials, permissions, a full server)."""
    tag = uuid.uuid4().hex[:12]
    keys = [f"{key_prefix}:probe:{tag}", f"{key_prefix}:probe:{tag}:stream"]
    client.eval(_PROBE_LUA, len(keys), *keys)


def data_nodes(client: redis.Redis) -> list[tuple[redis.Redis, bool]]:
    """Every data node behind ``client``, each as ``(a client of that node alone, whether
    the daemon's writes need it now)``: the one server; a cluster's masters (needed) and
    replicas; a Sentinel set's master (needed) and the replicas the Sentinels know. A replica
    becomes a master at the next failover, so its policy matters as much."""
    kind = topology(client)
    if kind == "cluster":
        return [(client.get_redis_connection(n), n.server_type == "primary")
                for n in client.get_nodes()]
    if kind != "sentinel":
        return [(client, True)]
    pool = client.connection_pool
    kw = {k: v for k, v in pool.connection_kwargs.items()
          if k in ("username", "password", "socket_timeout", "socket_connect_timeout",
                   "decode_responses") or k.startswith("ssl")}
    replicas = pool.sentinel_manager.discover_slaves(pool.service_name)
    return [(client, True), *((redis.Redis(host=h, port=p, **kw), False) for h, p in replicas)]


def check_server(client: redis.Redis, *, key_prefix: str = "libalign",
                 allow_unverified: bool = False) -> EvictionPolicy:
    """The daemon's start-up check of ``client``'s Redis (one attempt; see the module doc).

    Raises ConfigError for an evicting policy, an unreadable one (unless ``allow_unverified``:
    then a warning, counted), bad credentials and missing permissions. A full server is
    warned about, not refused: reads and deletes still work, and each write refused later is
    reported. Connection errors propagate, for the caller to retry.

    A cluster or a Sentinel set is checked node by node (:func:`data_nodes`): every node the
    client reaches must keep its keys; a replica that cannot be reached now is named in a
    warning (it is checked again at the next start), a master that cannot be reached is a
    connection error. The probe then runs through ``client`` itself (on a cluster, in the
    slot of ``key_prefix``'s hash tag).
    """
    if is_embedded(client):
        return read_eviction_policy(client)
    found = EvictionPolicy(REQUIRED_POLICY, "no node")
    for node, needed in data_nodes(client):
        try:
            found = _check_policy(node, allow_unverified)
        except redis.exceptions.ConnectionError as e:
            if needed or isinstance(e, CREDENTIAL_ERRORS):
                raise
            log.warning("could not check the maxmemory-policy of %s now: %s",
                        server_name(node), e)
        finally:
            if node is not client and topology(client) == "sentinel":
                node.close()  # made for this check; a cluster's node clients are its own
    name = server_name(client)
    try:
        probe_commands(client, key_prefix)
    except redis.exceptions.RedisError as e:
        typed = refusal(e, f"probing {name}")
        if typed is None:
            raise
        if isinstance(typed, ConfigError):
            raise typed from e
        log.warning("%s is full at start: %s", name, typed)
    return found


def _check_policy(client: redis.Redis, allow_unverified: bool) -> EvictionPolicy:
    """The eviction-policy part of :func:`check_server`, for one node."""
    name = server_name(client)
    try:
        found = read_eviction_policy(client)
    except redis.exceptions.RedisError as e:
        typed = refusal(e, f"checking {name}")
        if typed is None:
            raise
        raise typed from e
    if found.evicts:
        volatile = (" (a volatile-* policy evicts exactly the guidance records and rollouts, "
                    "which carry TTLs)" if found.policy.startswith("volatile") else "")
        raise ConfigError(
            f"{name} has maxmemory-policy {found.policy!r} ({found.source}): when it reaches "
            f"maxmemory it deletes the daemon's keys (versions, streams, guidance, rollouts) "
            f"without telling anyone{volatile}. {POLICY_FIX}")
    if found.policy is None:
        if not allow_unverified:
            raise ConfigError(
                f"cannot tell whether {name} may evict the daemon's keys: its maxmemory-policy "
                f"is unreadable ({found.source}). {POLICY_FIX}, and let the user run CONFIG "
                "GET or INFO; or set ALIGN_REDIS_ALLOW_UNVERIFIED_POLICY=true to start anyway")
        REDIS_POLICY_UNVERIFIED.inc()
        log.warning("STARTING UNVERIFIED: cannot read the maxmemory-policy of %s (%s) and "
                    "ALIGN_REDIS_ALLOW_UNVERIFIED_POLICY is set. If it is not noeviction, Redis "
                    "deletes the daemon's keys when it is full, silently.", name, found.source)
    return found
