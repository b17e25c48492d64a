"""Redis Cluster and Sentinel sets on loopback, started and stopped by the tests.

Each node is a real ``redis-server`` process on a free port in a temporary directory (the same
binary runs the Sentinels, with ``--sentinel``). Both topologies fail over fast: cluster nodes
and Sentinels call a silent master down after :data:`DOWN_MS`, so a killed master is replaced
within a few seconds, and the tests wait for that by polling with a deadline, never by sleeping
a fixed time. Every process started here is ended by ``stop()``.

* :class:`ClusterSet`: masters and, optionally, one replica per master, joined by
  ``redis-cli --cluster create``; :meth:`ClusterSet.kill_master_of` SIGKILLs the master that
  owns a key's slot and waits until its replica took over; :meth:`ClusterSet.migrate_slot`
  moves one slot, keys and all, to another master (``CLUSTER SETSLOT`` and ``MIGRATE``, as
  ``redis-cli --cluster reshard`` does), a batch of keys at a time, with a hook between
  batches for a test that writes while the slot is half moved.
* :class:`SentinelSet`: one master, one replica and three Sentinels watching them;
  :meth:`SentinelSet.kill_master` SIGKILLs the master and waits until the Sentinels promoted
  the replica.

Both have a ``heal()`` that starts the killed nodes again as replicas of the nodes that took
over, so that a topology shared by several tests has its shape back (every master with a
replica) before the next one kills a master again. The kill is also offered in two halves
(SIGKILL now, wait for the takeover later) for tests that kill while services run.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import redis

from tests.services.conftest import REDIS_SERVER, free_port
from tests.services.moved_time import wait_until

REDIS_CLI = shutil.which("redis-cli")
#: How long a silent master has until the cluster or the Sentinels call it down.
DOWN_MS = 500
#: Every node's server options: no persistence, keys never evicted, and a replica's full
#: synchronisation starts at once (Redis waits 5 s by default for more replicas to share it).
_COMMON = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--maxmemory-policy", "noeviction", "--repl-diskless-sync-delay", "0")


class _Node:
    """One redis-server process (a data node or a Sentinel)."""

    def __init__(self, workdir: Path, *extra: str, sentinel_conf: str | None = None):
        self.port = free_port()
        self.workdir = workdir / str(self.port)
        self.workdir.mkdir(parents=True)
        self.extra, self.sentinel_conf = extra, sentinel_conf
        self.proc: subprocess.Popen | None = None

    def start(self, *more: str) -> None:
        """Start the process (``more``: options for this start only, say ``--replicaof``)."""
        log = ["--logfile", str(self.workdir / "redis.log")]
        if self.sentinel_conf is not None:
            conf = self.workdir / "sentinel.conf"
            conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                            + self.sentinel_conf)
            cmd = [REDIS_SERVER, str(conf), "--sentinel", *log]
        else:
            cmd = [REDIS_SERVER, "--port", str(self.port), *_COMMON, "--dir", str(self.workdir),
                   *log, *self.extra, *more]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def client(self, **kw) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=5, **kw)

    def wait_ping(self) -> None:
        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                with self.client() as c:
                    return bool(c.ping())
            except redis.exceptions.RedisError:
                return False
        wait_until(up, f"redis-server on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: no goodbye to the replicas, the cluster or the Sentinels."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log(self) -> str:
        p = self.workdir / "redis.log"
        return p.read_text()[-2000:] if p.exists() else ""


def _is_synced_replica(node: _Node) -> bool:
    """Whether ``node`` answers as a replica whose link to its master is up."""
    try:
        with node.client(decode_responses=True) as c:
            info = c.info("replication")
    except redis.exceptions.RedisError:
        return False
    return info["role"] == "slave" and info.get("master_link_status") == "up"


class ClusterSet:
    """``masters`` cluster masters with ``replicas`` replicas each, on loopback."""

    def __init__(self, workdir: Path, *, masters: int = 3, replicas: int = 1,
                 maxmemory: str | None = None):
        mem = ("--maxmemory", maxmemory) if maxmemory else ()
        opts = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(DOWN_MS), *mem)
        self.replicas = replicas
        # the cluster bus listens on a port of its own, free too (not port + 10000)
        self.nodes = [_Node(workdir, *opts, "--cluster-port", str(free_port()))
                      for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        """``redis+cluster://`` with two seed nodes (any one would do)."""
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])
        return f"redis+cluster://{seeds}"

    def start(self) -> None:
        for n in self.nodes:
            n.start()
        for n in self.nodes:
            n.wait_ping()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas",
                              str(self.replicas), "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        wait_until(self._settled, "the cluster to agree on its slots", timeout_s=30)

    def _settled(self) -> bool:
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            try:
                with n.client(decode_responses=True) as c:
                    if c.cluster("info")["cluster_state"] != "ok":
                        return False
                    if c.info("replication")["role"] == "slave" and \
                            c.info("replication").get("master_link_status") != "up":
                        return False
            except redis.exceptions.RedisError:
                return False
        return True

    def live(self) -> list[_Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def owner(self, key: str) -> _Node:
        """The live master serving ``key``'s slot."""
        for n in self.live():
            with n.client(decode_responses=True) as c:
                if c.info("replication")["role"] != "master":
                    continue
                slot = c.cluster("keyslot", key)
                for lo, hi, *_ in c.cluster("slots"):
                    if lo <= slot <= hi and int(_[0][1]) == n.port:
                        return n
        raise AssertionError(f"no live master serves {key!r}")

    def kill_master_of(self, key: str) -> _Node:
        """SIGKILL the master of ``key``'s slot; return once a replica serves that slot."""
        victim = self.sigkill_owner(key)
        self.await_takeover(key, victim)
        return victim

    def sigkill_owner(self, key: str) -> _Node:
        """SIGKILL the master of ``key``'s slot and return at once (the killed node)."""
        victim = self.owner(key)
        victim.kill()
        return victim

    def await_takeover(self, key: str, victim: _Node) -> None:
        """Wait until a node other than ``victim`` serves ``key``'s slot and all agree."""
        def taken_over() -> bool:
            try:
                return self.owner(key) is not victim and self._settled()
            except (AssertionError, redis.exceptions.RedisError):
                return False
        wait_until(taken_over, f"a replica to take over {key!r}", timeout_s=30, poll_s=0.05)

    def heal(self) -> list[_Node]:
        """Start every killed node again; return them once each is a replica in sync.

        A restarted node reads its ``nodes.conf``, learns from the others that its slots
        went to its replica at a newer epoch, and becomes that node's replica (a full
        resynchronisation: it kept no data). The cluster then has its shape back: every
        master with a replica, so another master may be killed.
        """
        dead = [n for n in self.nodes if n.proc is None or n.proc.poll() is not None]
        for n in dead:
            n.start()
        for n in dead:
            n.wait_ping()
        wait_until(lambda: all(_is_synced_replica(n) and self._serves(n) for n in dead)
                   and self._settled(), "the restarted nodes to rejoin as replicas",
                   timeout_s=30)
        return dead

    def _serves(self, node: _Node) -> bool:
        """Whether every live node lists ``node`` in its slot map (no longer flagged failed),
        as a client that asks any of them will see it."""
        try:
            for n in self.live():
                with n.client() as c:
                    ports = {int(a[1]) for _lo, _hi, *addrs in c.cluster("slots") for a in addrs}
                if node.port not in ports:
                    return False
        except redis.exceptions.RedisError:
            return False
        return True

    def migrate_slot(self, key: str, *, batch: int = 100,
                     between: Callable[[], None] | None = None) -> tuple[int, int]:
        """Move ``key``'s slot, with its keys, to another master; (from port, to port).

        Keys move ``batch`` at a time; ``between()`` runs after each batch (a test waits
        there for writes to go on while the slot is half moved).
        """
        src = self.owner(key)
        masters = [n for n in self.live() if n is not src and
                   n.client(decode_responses=True).info("replication")["role"] == "master"]
        dst = masters[0]
        with src.client(decode_responses=True) as s, dst.client(decode_responses=True) as d:
            slot = s.cluster("keyslot", key)
            src_id, dst_id = s.cluster("myid"), d.cluster("myid")
            d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
                if between is not None:
                    between()
            for n in self.live():
                with n.client() as c:
                    if c.info("replication")["role"] == "master":
                        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        wait_until(self._settled, "the cluster to agree after the migration", timeout_s=30)
        return src.port, dst.port

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class SentinelSet:
    """One master, one replica and three Sentinels that watch them (master name ``align``)."""

    NAME = "align"

    def __init__(self, workdir: Path, *, maxmemory: str | None = None):
        mem = ("--maxmemory", maxmemory) if maxmemory else ()
        self.master = _Node(workdir, *mem)
        self.replica = _Node(workdir, "--replicaof", "127.0.0.1", str(self.master.port), *mem)
        conf = (f"sentinel monitor {self.NAME} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.NAME} {DOWN_MS}\n"
                f"sentinel failover-timeout {self.NAME} 5000\n"
                f"sentinel known-replica {self.NAME} 127.0.0.1 {self.replica.port}\n")
        self.sentinels = [_Node(workdir, sentinel_conf=conf) for _ in range(3)]
        # each Sentinel told its own id and the others' up front: no discovery rounds to wait
        ids = [f"{i + 1:040x}" for i in range(3)]
        for i, s in enumerate(self.sentinels):
            s.sentinel_conf = conf + f"sentinel myid {ids[i]}\n" + "".join(
                f"sentinel known-sentinel {self.NAME} 127.0.0.1 {o.port} {ids[j]}\n"
                for j, o in enumerate(self.sentinels) if j != i)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.NAME}"

    def all(self) -> list[_Node]:
        return [self.master, self.replica, *self.sentinels]

    def start(self) -> None:
        for n in self.all():
            n.start()
        for n in self.all():
            n.wait_ping()
        wait_until(lambda: self._master_port() == self.master.port and self._synced(),
                   "the Sentinels to see the master and its replica", timeout_s=30)

    def _master_port(self) -> int | None:
        try:
            with self.sentinels[0].client(decode_responses=True) as c:
                addr = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.NAME)
                return int(addr[1]) if addr else None
        except redis.exceptions.RedisError:
            return None

    def _synced(self) -> bool:
        try:
            with self.master.client(decode_responses=True) as m:
                if "online" not in str(m.info("replication").get("slave0", "")):
                    return False
            with self.sentinels[0].client(decode_responses=True) as c:
                return len(c.execute_command("SENTINEL", "REPLICAS", self.NAME)) >= 1 and \
                    len(c.execute_command("SENTINEL", "SENTINELS", self.NAME)) >= 2
        except redis.exceptions.RedisError:
            return False

    def kill_master(self) -> None:
        """SIGKILL the master; return once the Sentinels name the replica master."""
        self.master.kill()
        self.await_promotion()

    def await_promotion(self) -> None:
        """After the master was killed: wait until the Sentinels name the replica master,
        then call it :attr:`master` (and the dead node :attr:`replica`, for :meth:`heal`)."""
        wait_until(lambda: self._master_port() == self.replica.port,
                   "the Sentinels to promote the replica", timeout_s=30, poll_s=0.05)
        self.master, self.replica = self.replica, self.master

    def heal(self) -> bool:
        """Start a killed node again as the replica of the master the Sentinels named;
        return once it is in sync and the Sentinels list it (False: nothing was dead)."""
        if self.replica.proc is not None and self.replica.proc.poll() is None:
            return False
        self.replica.start("--replicaof", "127.0.0.1", str(self.master.port))
        self.replica.wait_ping()
        wait_until(lambda: _is_synced_replica(self.replica) and self._synced(),
                   "the restarted node to rejoin as a replica", timeout_s=30)
        return True

    def stop(self) -> None:
        for n in self.all():
            n.stop()
