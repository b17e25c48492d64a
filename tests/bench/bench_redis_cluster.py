"""Guidance store on a 3-master Redis Cluster against one Redis node, in the same run.

Both are started here on loopback, each node with the same ``--maxmemory`` and
``noeviction``: one ``redis-server``, and a cluster of ``--masters`` masters without
replicas (``tests.services.redis_topologies.ClusterSet``). On each:

1. throughput: ``put_many`` then ``get_many`` of ``--versions`` versions of ``--rollouts``
   records of ``--record-bytes`` (seeded random bytes; best of ``--repeats``), through
   ``GuidanceStore.from_settings``: one store on the node, ``--shards`` shards on the
   cluster. MB/s = payload bytes / seconds / 1e6;
2. capacity: versions put (no budget) until Redis refuses a write (RedisFullError, "Redis is
   full"); the payload bytes stored then is the largest guidance set that topology holds.

On a host with few cores every node shares the same CPUs and the cluster client routes each
transaction itself, so the throughput ratio shows the cluster's overhead, not its scaling;
the capacity ratio is what more masters buy. Every record read back is compared with what
was written. Run: ``python -m tests.bench redis_cluster [-- --quick] [-- --out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from alignclient.errors import RedisFullError
from alignd.infra.settings import ApiSettings
from alignd.infra.stores.guidance import GuidanceStore

from tests.services.redis_topologies import ClusterSet, _Node


def _records(rng: np.random.Generator, rollouts: int, size: int) -> dict[str, bytes]:
    return {f"r{i}": rng.bytes(size) for i in range(rollouts)}


def throughput(store, data: dict[str, dict[str, bytes]], repeats: int) -> dict[str, float]:
    """Best put and get MB/s over ``repeats`` rounds of every version in ``data``."""
    nbytes = sum(len(b) for recs in data.values() for b in recs.values())
    best_put = best_get = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        for v, recs in data.items():
            store.put_many(v, recs)
        best_put = max(best_put, nbytes / (time.perf_counter() - t) / 1e6)
        t = time.perf_counter()
        for v, recs in data.items():
            got = store.get_many(v, list(recs))
            assert got == recs, f"version {v} read back wrong"
        best_get = max(best_get, nbytes / (time.perf_counter() - t) / 1e6)
        for v in data:
            store.delete_version(v)
    return {"put_MBps": best_put, "get_MBps": best_get, "bytes": nbytes}


def capacity(store, rng: np.random.Generator, rollouts: int, size: int) -> int:
    """Payload bytes stored when Redis first refuses a put (versions put until then)."""
    recs = _records(rng, rollouts, size)
    stored, i = 0, 0
    while True:
        try:
            store.put_many(f"fill{i}", recs)
        except RedisFullError:
            return stored
        stored += rollouts * size
        i += 1


def measure(url: str, shards: int, args, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    data = {f"v{i}": _records(rng, args.rollouts, args.record_bytes)
            for i in range(args.versions)}
    st = ApiSettings(redis_url=url, guidance_budget_bytes=None, guidance_ttl_s=None,
                     guidance_shards=shards, redis_retry_s=10.0)
    with GuidanceStore.from_settings(st) as store:
        out = throughput(store, data, args.repeats)
        out["capacity_bytes"] = capacity(store, rng, args.rollouts, args.fill_bytes)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_redis_cluster", description=__doc__)
    p.add_argument("--masters", type=int, default=3)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--versions", type=int, default=16)
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--record-bytes", type=int, default=256 << 10)
    p.add_argument("--fill-bytes", type=int, default=1 << 20, help="record size while filling")
    p.add_argument("--maxmemory", default="96mb", help="each node's maxmemory")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--out", metavar="DIR", help="write bench_redis_cluster.json here")
    args = p.parse_args(argv)
    if args.quick:
        args.versions, args.rollouts, args.repeats, args.maxmemory = 4, 4, 1, "16mb"
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    single = _Node(work, "--maxmemory", args.maxmemory)
    cluster = ClusterSet(work / "cluster", masters=args.masters, replicas=0,
                         maxmemory=args.maxmemory)
    try:
        single.start()
        single.wait_ping()
        cluster.start()
        one = measure(f"redis://127.0.0.1:{single.port}/0", 1, args, seed=0)
        many = measure(cluster.url, args.shards, args, seed=0)
    finally:
        single.stop()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    doc = {"one_node": one, "cluster": many, "masters": args.masters, "shards": args.shards,
           "maxmemory_per_node": args.maxmemory, "cores": os.cpu_count(),
           "ratio_put": many["put_MBps"] / one["put_MBps"],
           "ratio_get": many["get_MBps"] / one["get_MBps"],
           "ratio_capacity": many["capacity_bytes"] / max(1, one["capacity_bytes"])}
    print(f"{'':>12} {'put MB/s':>10} {'get MB/s':>10} {'largest set (MB)':>18}")
    for name, r in (("one node", one), (f"{args.masters} masters", many)):
        print(f"{name:>12} {r['put_MBps']:>10.1f} {r['get_MBps']:>10.1f} "
              f"{r['capacity_bytes'] / 1e6:>18.1f}")
    print(f"cluster / one node: put {doc['ratio_put']:.2f}, get {doc['ratio_get']:.2f} "
          f"(overhead on {os.cpu_count()} cores, not scaling), largest set "
          f"{doc['ratio_capacity']:.2f}x (each node --maxmemory {args.maxmemory})")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_redis_cluster.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0
