"""The daemon on Redis's own scale-out engines: a Redis Cluster and a Sentinel set.

Each topology starts once per module (:mod:`tests.services.redis_topologies`): a cluster of 3
masters with a replica each, and a Sentinel set of three watching one master and its
replica, all on loopback; a node a test killed is started again as a replica after it, so the
next test finds every master replicated. On each topology:

* the registry, the event streams and the guidance store run a workload of their own; a master
  is SIGKILLed mid-run; the stores go on after the failover, and every write acknowledged
  before the kill (with ``redis_wait_replicas=1``: after ``WAIT``) is read back;
* the RL loop runs through the services (:class:`RLRun`: converter and sampler threads, the
  learner loop, TRACE guidance), with the master SIGKILLed while a step is in flight.

On the cluster a guidance shard's slot is also migrated between steps of the workload, and
again while a writer thread puts records into it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import redis
from alignclient.errors import ConfigError
from alignd.infra.bus import RedisBus
from alignd.infra.events import event_stream
from alignd.infra.keyspace import hash_tag, shard_of, shard_prefix, tagged_prefix
from alignd.infra.redis_checks import check_server
from alignd.infra.redis_clients import (
    binary_client,
    parse_redis_url,
    redact_url,
    text_client,
    topology,
)
from alignd.infra.registry import Registry
from alignd.infra.settings import ApiSettings
from alignd.infra.stores.guidance import GuidanceStore
from alignd.infra.stores.guidance_shards import ShardedGuidanceStore
from alignd.infra.telemetry import REDIS_UNREPLICATED
from pydantic import ValidationError
from redis.cluster import key_slot

from tests.services.conftest import REDIS_SERVER
from tests.services.moved_time import wait_until
from tests.services.redis_topologies import REDIS_CLI, ClusterSet, SentinelSet

needs_servers = pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None,
                                   reason="redis-server and redis-cli are not installed")

LEARNER = "learner"
PATH = ["published", "converting", "converted", "loading", "serving"]


def test_urls_name_their_topology_and_never_print_a_password():
    """Cluster and Sentinel URLs parse (hosts, master, db, TLS, ACL user); a password shows only
    as ***; a cluster's key prefix gets a hash tag and streams must share it; shards land in
    slots of their own."""
    c = parse_redis_url("rediss+cluster://app:s3cr%40t@h1:7000,h2:7001?ssl_cert_reqs=none")
    assert (c.kind, c.hosts, c.username, c.password, c.tls) == (
        "cluster", (("h1", 7000), ("h2", 7001)), "app", "s3cr@t", True)
    assert "s3cr" not in str(c) and "s3cr" not in repr(c) and "app:***@h1" in str(c)
    s = parse_redis_url("redis+sentinel://:pw@h1:26379,h2:26379/mymaster/2")
    assert (s.kind, s.master, s.db, s.password, s.tls) == ("sentinel", "mymaster", 2, "pw", False)
    assert redact_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    for bad in ("redis+sentinel://h1:1", "redis+cluster://h1", "redis+cluster://h:1/0",
                "redis+cluster://u:pw@h:1?password=x"):
        with pytest.raises(ConfigError) as e:
            parse_redis_url(bad)
        assert "pw" not in str(e.value).replace("password", "")
    st = ApiSettings(redis_url="redis+cluster://h:1")
    assert st.key_prefix == "{libalign}" and st.published_stream == "{libalign}:events:published"
    assert ApiSettings(redis_url="redis+cluster://h:1", key_prefix="{t}:a").key_prefix == "{t}:a"
    assert ApiSettings().key_prefix == "libalign"  # one server: the layout of earlier releases
    with pytest.raises(ValidationError, match="hash tag"):
        ApiSettings(redis_url="redis+cluster://h:1", published_stream="elsewhere")
    assert shard_prefix("libalign", 0, 1) == "libalign:guidance"
    slots = {key_slot(shard_prefix("{libalign}", i, 16).encode()) for i in range(16)}
    assert len(slots) == 16 and key_slot(tagged_prefix("libalign").encode()) not in slots
    assert hash_tag(shard_prefix("{libalign}", 3, 16)) == "libalign:guidance:3"


@pytest.fixture(scope="module")
def cluster_set(tmp_path_factory):
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli are not installed")
    cs = ClusterSet(tmp_path_factory.mktemp("cluster"))
    try:
        cs.start()
        yield cs
    finally:
        cs.stop()


@pytest.fixture(scope="module")
def sentinel_set(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    ss = SentinelSet(tmp_path_factory.mktemp("sentinel"))
    try:
        ss.start()
        yield ss
    finally:
        ss.stop()


@pytest.fixture
def cluster(cluster_set):
    """The module's cluster; the masters a test killed come back as replicas after it."""
    yield cluster_set
    cluster_set.heal()


@pytest.fixture
def sentinels(sentinel_set):
    """The module's Sentinel set; a master a test killed comes back as the replica after it."""
    yield sentinel_set
    sentinel_set.heal()


def _settings(url: str, **kw) -> ApiSettings:
    return ApiSettings(redis_url=url, redis_retry_s=30.0, redis_wait_replicas=1,
                       redis_wait_timeout_ms=200, guidance_budget_bytes=1 << 30, **kw)


class Workload:
    """Versions through the registry with their events, guidance records for each."""

    def __init__(self, settings: ApiSettings):
        self.settings = settings
        self.text = text_client(settings)
        self.bus = RedisBus.from_settings(settings)
        self.registry = Registry(self.bus, settings.key_prefix)
        self.stream = event_stream(settings.key_prefix, "published")
        self.bus.ensure_group(self.stream, "converters")
        self.guidance = GuidanceStore.from_settings(settings)
        self.acked: dict[str, bytes] = {}
        self.read_before: set[str] = set()

    def record(self, vid: str) -> bytes:
        return (vid.encode() * 4096)[:20_000 + len(self.acked)]

    def step(self, vid: str) -> None:
        """Publish ``vid`` with its event, walk it to serving, store and lease its guidance."""
        self.registry.create_and_announce(vid, f"/store/{vid}", self.stream, {"version": vid},
                                          actor=LEARNER)
        for target in PATH[1:]:
            self.registry.transition(vid, target, actor="converter")
        self.guidance.put_many(vid, {"r0": self.record(vid), "r1": b"x" * 100})
        self.acked[vid] = self.record(vid)

    def check(self) -> None:
        """Everything acknowledged is there: records, histories, events, guidance."""
        for vid, blob in self.acked.items():
            assert self.registry.state(vid) == "serving"
            assert [h.to_state for h in self.registry.history(vid)] == PATH
            assert self.guidance.get(vid, "r0") == blob
        events = self.bus.read(self.stream, "converters", "c1", count=1000, block_ms=10)
        assert {m.fields["version"] for m in events} >= set(self.acked) - self.read_before
        self.read_before |= {m.fields["version"] for m in events}

    def after_failover(self, vid: str) -> None:
        """One step with the lost replica still asked for (its WAITs time out: counted), then
        the rest without WAIT: the killed master was the promoted replica's only peer."""
        before = REDIS_UNREPLICATED._value.get()
        self.step(vid)
        # the registry's writes at least (a guidance shard may live on a master with a replica)
        assert REDIS_UNREPLICATED._value.get() - before >= len(PATH)
        stores = getattr(self.guidance, "stores", [self.guidance])
        for bus in (self.bus, *(s.bus for s in stores)):
            bus.wait_replicas = 0

    def close(self) -> None:
        self.guidance.close()
        self.bus.client.close()
        self.text.close()


@needs_servers
def test_cluster_keeps_acknowledged_writes_through_failover_and_slot_migration(cluster):
    """On 3 masters + replicas: the start-up check passes (every node noeviction); guidance
    shards spread over the masters; the master of the control slot killed mid-run and a
    guidance shard's slot migrated mid-run lose nothing acknowledged, and the run goes on."""
    st = _settings(cluster.url)
    assert st.guidance_shards == 16
    check_server(text_client(st), key_prefix=st.key_prefix)
    w = Workload(st)
    try:
        assert topology(w.text) == "cluster" and isinstance(w.guidance, ShardedGuidanceStore)
        assert w.guidance.payload_path == "pipeline"
        for i in range(6):
            w.step(f"c{i}")
        w.check()
        masters = {cluster.owner(s.keys.version("x")).port for s in w.guidance.stores}
        assert len(masters) == 3, "the shards should spread over every master"
        cluster.kill_master_of(st.key_prefix)  # registry, streams and their groups fail over
        w.after_failover("c6")
        for i in range(7, 10):
            w.step(f"c{i}")
        w.check()
        shard = w.guidance.shard("c3")
        moved = cluster.migrate_slot(shard.keys.version("c3"))
        assert moved[0] != moved[1]
        for i in range(10, 13):
            w.step(f"c{i}")
        w.check()
        assert shard_of("c3", 16) == w.guidance.stores.index(shard)
        assert sum(v.rollouts for v in w.guidance.versions()) == 2 * len(w.acked)
    finally:
        w.close()


@needs_servers
def test_cluster_start_check_refuses_an_evicting_node(cluster):
    """One replica with allkeys-lru is enough to refuse the cluster at start, naming it."""
    st = _settings(cluster.url)
    client = text_client(st)
    replica = next(n for n in cluster.live()
                   if n.client(decode_responses=True).info("replication")["role"] == "slave")
    with replica.client() as r:
        r.config_set("maxmemory-policy", "allkeys-lru")
        try:
            with pytest.raises(ConfigError, match=f"{replica.port}.*allkeys-lru"):
                check_server(client, key_prefix=st.key_prefix)
        finally:
            r.config_set("maxmemory-policy", "noeviction")
    check_server(client, key_prefix=st.key_prefix)
    client.close()


@needs_servers
def test_sentinel_keeps_acknowledged_writes_through_failover(sentinels):
    """Through the Sentinels: the check covers master and replica, a version walks the registry
    with guidance on the socket payload path, the master is SIGKILLed, the clients find the
    promoted replica and every write acknowledged after WAIT is there."""
    st = _settings(sentinels.url)
    assert st.key_prefix == "libalign" and st.guidance_shards == 1
    client = text_client(st)
    check_server(client, key_prefix=st.key_prefix)
    with sentinels.replica.client() as r:
        r.config_set("maxmemory-policy", "volatile-lru")
        try:
            with pytest.raises(ConfigError, match="volatile-lru"):
                check_server(client, key_prefix=st.key_prefix)
        finally:
            r.config_set("maxmemory-policy", "noeviction")
    client.close()
    w = Workload(st)
    try:
        assert topology(w.text) == "sentinel" and w.guidance.payload_path == "socket"
        for i in range(6):
            w.step(f"s{i}")
        w.check()
        sentinels.kill_master()
        w.after_failover("s6")
        for i in range(7, 10):
            w.step(f"s{i}")
        w.check()
        with binary_client(st) as b:
            assert b.get(b"libalign:guidance:total") is not None  # the one-server key layout
    finally:
        w.close()


def test_sentinel_and_cluster_clients_raise_connection_errors_for_the_bus_to_retry():
    """With nothing listening, both kinds fail as connection errors (retried by the bus, which
    gives up with BusUnavailableError), never hanging in a retry loop of redis-py's own."""
    from alignclient.errors import BusUnavailableError
    from alignclient.retry import RetryPolicy

    from tests.services.conftest import free_port
    for url in (f"redis+sentinel://127.0.0.1:{free_port()}/m",
                f"redis+cluster://127.0.0.1:{free_port()}"):
        bus = None
        try:
            st = ApiSettings(redis_url=url)
            client = text_client(st)
            bus = RedisBus(client, retry=RetryPolicy(initial_s=0.01, max_s=0.02, deadline_s=0.2))
            with pytest.raises(BusUnavailableError):
                bus.call("PING", client.ping)
        except redis.exceptions.RedisClusterException as e:  # no seed node answered
            assert "127.0.0.1" in str(e)


@needs_servers
def test_redis_migrate_moves_one_server_into_the_cluster_layout(cluster, redis_url):
    """What a single server wrote (registry, history, events with a consumer group, guidance)
    reads on the cluster after ``alignd redis-migrate``, under the tagged prefix; guidance
    left out on request."""
    from alignd.tools.cli import app
    from typer.testing import CliRunner
    old = ApiSettings(redis_url=redis_url, key_prefix="mig", redis_retry_s=5.0)
    w = Workload(old)
    try:
        w.step("m1")
        w.bus.read(w.stream, "converters", "c1", count=10, block_ms=10)  # one pending entry
    finally:
        w.close()
    run = CliRunner().invoke(app, ["redis-migrate", "--from", redis_url, "--to", cluster.url,
                                   "--key-prefix", "mig"])
    assert run.exit_code == 0, run.output
    assert "keys copied" in run.output
    new = _settings(cluster.url, key_prefix="mig", guidance_shards=1)
    assert new.key_prefix == "{mig}"
    w = Workload(new)
    try:
        assert [h.to_state for h in w.registry.history("m1")] == PATH
        assert w.guidance.get("m1", "r0") == (b"m1" * 4096)[:20_000]
        assert w.bus.pending_count(w.stream, "converters") == 1
    finally:
        w.close()
    again = CliRunner().invoke(app, ["redis-migrate", "--from", redis_url, "--to", cluster.url,
                                     "--key-prefix", "mig", "--skip-guidance"])
    assert "0 keys copied" in again.output and "guidance keys left out" in again.output


# --- the services on each topology ---------------------------------------------------------


class RLRun:
    """The RL loop through the services on one Redis URL, as ``alignd up`` runs them: the
    converter and a sampler as threads (:class:`~alignd.tools.in_process.ServiceThreads`), the
    learner loop in the test's thread. The tiny MoE on the NVFP4 path with TRACE guidance: each
    step publishes a BF16 version, the converter converts it, the sampler loads it, generates 2
    prompts x 2 samples and stores their rollouts and guidance records, the learner reads both
    back, scores and trains. ``kill(step)`` runs right after a step's version is announced."""

    def __init__(self, url: str, store_dir, prefix: str):
        from alignd.formats.weight_store import WeightStore
        from alignd.infra.settings import AllInOneSettings
        from alignd.infra.stores.rollouts import RolloutStore
        from alignd.infra.telemetry import Metrics
        from alignd.learner.engine import TorchLearnerEngine
        from alignd.learner.loop import LearnerLoop, LoopParts, RolloutPlan
        from alignd.sampler.engine import TorchSamplerEngine
        from alignd.tools.in_process import ServiceThreads

        from libalign import models

        task = models.SyntheticTask()
        self.settings = st = AllInOneSettings(
            redis_url=url, key_prefix=prefix, store_dir=store_dir, sampler_path="nvfp4_minite",
            learner_path="nvfp4_trace", block_ms=50, heartbeat_ms=100, consumer_name="conv",
            sampler_name="s1", redis_retry_s=30.0, redis_wait_replicas=1,
            redis_wait_timeout_ms=200, guidance_budget_bytes=1 << 30)
        self.metrics = Metrics()
        self.bus = RedisBus.from_settings(st)
        self.rollouts = RolloutStore(binary_client(st), st.key_prefix)
        self.guidance = GuidanceStore.from_settings(st)
        model = models.build_model(models.tiny_config(num_hidden_layers=2), seed=5)
        self.engine = TorchSamplerEngine(copy.deepcopy(model), WeightStore(st.store_dir),
                                         st.sampler_path, batch_size=16, eos_id=task.eos_id,
                                         pad_id=task.pad_id)
        self.services = ServiceThreads(st, self.engine, rollouts=self.rollouts,
                                       guidance=self.guidance, metrics=self.metrics)
        parts = LoopParts.build(st, bus=self.bus, rollouts=self.rollouts, guidance=self.guidance)
        self.registry = parts.registry
        self.loop = LearnerLoop(
            st, TorchLearnerEngine(model, st.learner_path, pad_id=task.pad_id, lr=1e-4), parts,
            RolloutPlan(prompts=lambda step: task.prompts(2, step), reward=task.verify,
                        sampler_path=st.sampler_path, prompts_per_step=2, samples_per_prompt=2,
                        max_new_tokens=4, timeout_s=60))
        self.kill: Callable[[int], None] = lambda step: None
        publish = self.loop.publish

        def publish_then_kill(step: int) -> str:
            vid = publish(step)
            self.kill(step)
            return vid
        self.loop.publish = publish_then_kill

    def records(self, vid: str) -> dict[str, bytes]:
        """The version's guidance records (4, one per rollout), read through the store."""
        ids = self.guidance.rollouts(vid)
        assert len(ids) == 4
        return self.guidance.get_many(vid, ids)

    def check(self, results) -> None:
        """Every step went the whole way: its version published, converted, loaded and
        serving (the history in order), rollouts scored and trained on, guidance stored; one
        ``published`` event per version (none without its version, none twice)."""
        assert self.bus.client.xlen(self.settings.published_stream) == len(results)
        for r in results:
            assert [h.to_state for h in self.registry.history(r.version_id)][:5] == PATH
            assert r.delta["tokens"] > 0 and r.train["tokens"] == r.delta["tokens"]
            assert all(self.records(r.version_id).values())
        assert self.engine.version_id == results[-1].version_id

    def close(self) -> None:
        self.services.close()
        self.guidance.close()
        self.rollouts.client.close()
        self.bus.client.close()


def _run_through_a_failover(run: RLRun, kill: Callable[[], None],
                            recover: Callable[[], None]) -> None:
    """Step 0; step 1 with the master SIGKILLed (``kill``) right after its version is
    announced, so the converter, the sampler and the learner meet the failover with work in
    flight; ``recover`` (wait for the takeover, start the dead node again as a replica) runs
    on a thread meanwhile; step 2 after it. What step 0 wrote, and step 1's announcement, were
    acknowledged (after WAIT) before the kill: all of it must still be there."""
    first = run.loop.iteration(0)
    before = run.records(first.version_id)
    healer: list[threading.Thread] = []
    errors: list[BaseException] = []

    def heal() -> None:
        try:
            recover()
        except BaseException as e:  # surfaced by the test below
            errors.append(e)

    def kill_at(step: int) -> None:
        if step == 1:
            kill()
            healer.append(threading.Thread(target=heal, name="heal", daemon=True))
            healer[0].start()
    run.kill = kill_at
    retried = run.metrics.redis_retries._value.get()
    try:
        results = [first, run.loop.iteration(1)]
    finally:
        for t in healer:
            t.join(60)
    assert errors == [] and healer and not healer[0].is_alive()
    results.append(run.loop.iteration(2))
    run.check(results)
    assert run.metrics.redis_retries._value.get() > retried  # the converter met the failover
    assert run.records(first.version_id) == before
    assert len({r.version_id for r in results}) == 3


@needs_servers
@pytest.mark.usefixtures("one_thread")
def test_rl_loop_and_converter_run_on_the_cluster_through_a_master_failover(cluster, tmp_path):
    """The converter, a sampler and the learner loop on ``redis+cluster://``: three steps reach
    ``serving``, are rolled out, scored and trained on, with guidance records stored by the
    sampler and read by the learner; the master of the run's control slot (registry, streams,
    groups) is SIGKILLed with step 1 in flight: every service reconnects to the promoted
    replica, the run finishes, and step 0's records and guidance are intact."""
    pytest.importorskip("transformers")
    run = RLRun(cluster.url, tmp_path / "store", "rl")
    try:
        assert run.settings.key_prefix == "{rl}" and run.guidance.payload_path == "pipeline"
        victim: list = []
        _run_through_a_failover(
            run, kill=lambda: victim.append(cluster.sigkill_owner(run.settings.key_prefix)),
            recover=lambda: (cluster.await_takeover(run.settings.key_prefix, victim[0]),
                             cluster.heal()))
        assert cluster.owner(run.settings.key_prefix) is not victim[0]
    finally:
        run.close()


@needs_servers
@pytest.mark.usefixtures("one_thread")
def test_rl_loop_and_converter_run_on_sentinel_through_a_master_failover(sentinels, tmp_path):
    """The same run on ``redis+sentinel://.../align``: the master SIGKILLed with step 1 in
    flight, the Sentinels promote the replica, every service asks them again and goes on; the
    run finishes and step 0's records and guidance are intact."""
    pytest.importorskip("transformers")
    run = RLRun(sentinels.url, tmp_path / "store", "rl")
    old = sentinels.master.port
    try:
        assert topology(run.bus.client) == "sentinel"
        _run_through_a_failover(run, kill=sentinels.master.kill,
                                recover=lambda: (sentinels.await_promotion(), sentinels.heal()))
        assert sentinels.master.port != old
    finally:
        run.close()


@needs_servers
def test_guidance_puts_in_flight_while_their_slot_migrates_are_all_kept(cluster):
    """A writer thread puts guidance records to versions of one shard, reading each back,
    while the test moves that shard's slot to another master 10 keys per ``MIGRATE``, waiting
    after each batch until a put is in flight. A put that meets the half-moved slot gets
    ``ASK``/``MOVED`` for its ``MULTI``/``EXEC`` (the server ran none of it) and is retried
    until the slot has settled: no put fails, every acknowledged one reads back whole after
    the move, the shard's byte count is exactly theirs, and no chunk without its record is
    left in the slot."""
    from alignd.infra.telemetry import Metrics

    metrics = Metrics()
    st = _settings(cluster.url, key_prefix="mig")
    guidance = GuidanceStore.from_settings(st, metrics=metrics)
    target = shard_of("m0", st.guidance_shards)
    shard = guidance.stores[target]
    vids = [v for v in (f"m{i}" for i in range(4000)) if shard_of(v, 16) == target]
    acked: dict[str, dict[str, bytes]] = {}
    failed: list[BaseException] = []
    stop, in_put = threading.Event(), threading.Event()

    def write() -> None:
        try:
            for v in vids:
                if stop.is_set():
                    return
                recs = {f"r{j}": (v.encode() * 2000)[:4000 + j] for j in range(3)}
                in_put.set()
                guidance.put_many(v, recs)
                in_put.clear()
                acked[v] = recs
                assert guidance.get_many(v, list(recs)) == recs
        except BaseException as e:  # surfaced below
            failed.append(e)

    writer = threading.Thread(target=write, name="guidance-writer", daemon=True)
    writer.start()
    try:
        wait_until(lambda: len(acked) >= 20 or failed, "20 versions put before the move")
        retries = metrics.redis_retries._value.get()
        src, dst = cluster.migrate_slot(
            shard.keys.version("m0"), batch=10,
            between=lambda: wait_until(lambda: in_put.is_set() or failed, "a put in flight"))
        assert src != dst and cluster.owner(shard.keys.version("m0")).port == dst
        after = len(acked)
        wait_until(lambda: len(acked) >= after + 3 or failed, "puts after the move")
    finally:
        stop.set()
        writer.join(60)
    try:
        assert failed == [] and not writer.is_alive()
        assert metrics.redis_retries._value.get() > retries, "no put met the moving slot"
        for v, recs in acked.items():
            assert guidance.get_many(v, list(recs)) == recs
        size = sum(len(b) for recs in acked.values() for b in recs.values())
        assert shard.total_bytes() == size == sum(v.bytes for v in shard.versions())
        for key in guidance.client.scan_iter(match=shard.prefix + ":v:*:c:*", count=1000):
            v, _c, r, gen, _i = key.decode()[len(shard.prefix) + 3:].split(":")
            assert guidance.client.hget(shard.keys.rollout(v, r), "gen") == gen.encode(), key
    finally:
        guidance.close()


@needs_servers
def test_a_watch_broken_by_a_failover_is_retried_not_called_a_taken_id(redis_url):
    """A cluster's pipeline reports a connection lost (or a slot redirected) while it watched
    a version's record as WatchError raised from that error. The publish is tried again and
    the version made once, with one event, instead of VersionExistsError for an id nobody took;
    a WatchError of its own (a concurrent writer) still names the taken id."""
    from alignclient.errors import VersionExistsError

    st = ApiSettings(redis_url=redis_url, key_prefix="watch", redis_retry_s=5.0)
    bus = RedisBus.from_settings(st)
    registry = Registry(bus, st.key_prefix)
    pipeline = bus.client.pipeline
    broken: list[BaseException] = []

    def breaking_pipeline(*a, **kw):
        pipe = pipeline(*a, **kw)
        execute = pipe.execute

        def execute_once_broken(*ea, **ekw):
            if broken:
                err = redis.exceptions.WatchError("An error occurred while watching keys")
                raise err from broken.pop()
            return execute(*ea, **ekw)
        pipe.execute = execute_once_broken
        return pipe
    bus.client.pipeline = breaking_pipeline
    try:
        broken.append(redis.exceptions.ConnectionError("Connection closed by server."))
        registry.create_and_announce("w1", "/p", st.published_stream, {"version_id": "w1"})
        assert broken == [] and registry.state("w1") == "published"
        assert bus.client.xlen(st.published_stream) == 1
        broken.append(redis.exceptions.ResponseError("not a failover"))
        with pytest.raises(VersionExistsError):
            registry.create_and_announce("w2", "/p", st.published_stream, {"version_id": "w2"})
    finally:
        bus.client.close()
