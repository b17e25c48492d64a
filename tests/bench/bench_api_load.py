"""Control API under load: many concurrent clients against one uvicorn process.

The bench starts its own redis-server (no persistence) and the API as a separate process
(``python -m alignd.api.main``, one uvicorn worker, so the load generator does not share
its GIL), registers one tiny published version ``v1``, then runs ``--clients`` concurrent
``httpx.AsyncClient`` loops in phases of equal length (``--seconds`` in all), every client
hitting the phase's endpoint as fast as it answers:

1. ``GET /healthz``: the cheapest route, the baseline the others are compared with;
2. ``GET /v1/status``: versions, heartbeats, discrepancy and guidance totals from Redis;
3. ``POST /v1/versions/v1/rollouts``: one rollout of 64 completion tokens per request;
4. ``POST /v1/versions/v1/scores``: learner log-probs for the rollouts stored in phase 3
   (a new learner path name each pass over them);
5. ``PUT /v1/guidance/v1/{rollout}``: a ``--record-kib`` KiB record (16 ids per client,
   overwritten in turn);
6. ``GET /v1/guidance/v1/{rollout}``: those records read back.

Each client has its own ``AsyncClient`` (one keep-alive connection); each phase first
opens them (one ``/healthz`` each, not counted).

Then overload, after ``--versions`` (2,000) more versions are registered, each
phase ``--overload-seconds`` long, measured by ``--probes`` liveness probes that each open a
new connection per ``GET /healthz`` (as an orchestrator's probe does):

7. ``probe /healthz``: the probes alone;
8. ``probe | 40 status``: while ``--status-clients`` (40) clients in another process loop on
   ``GET /v1/status`` (its answered count is printed below the table);
9. ``probe | half-open``: while another process opens ``--half-open`` (20,000) connections
   at ``--half-open-rate`` a second, each sending half a request head and then nothing
   (kept until the server closes them; how many it closed is printed).

The API runs with its default limits (printed: header deadline, keep-alive, connection
limit, heavy-read concurrency, status cache).

Per endpoint: requests, errors (non-2xx or transport errors), throughput (requests /
phase seconds), p50 and p99 latency, and both relative to ``/healthz``. Then the guidance
store without HTTP: ``--learners`` processes each ``get_many`` a batch of ``--batch``
records of ``--learner-record-kib`` KiB while one writer process ``put_many``\\ s new
batches, for ``--store-seconds``; MB/s = payload bytes / seconds / 1e6.

Defaults: 200 clients for 60 s, overload phases of 10 s and 20,000 half-open connections.
``--quick``: 50 clients for 10 s, overload phases of 5 s and 5,000 half-open connections.
Run: ``python -m tests.bench api_load [-- --quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis

TOKEN = "bench-token-5d1c0a"
PHASES = ("GET /healthz", "GET /v1/status", "POST rollouts", "POST scores", "PUT guidance",
          "GET guidance")
GUIDANCE_IDS = 16
COMPLETION = 64
OVERLOAD = ("probe /healthz", "probe | 40 status", "probe | half-open")
PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: flood\r\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)


class _Stack:
    """redis-server and the API in separate processes, in a temporary directory."""

    def __init__(self, max_body: int) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (./dev.sh test installs it)")
        self.dir = Path(tempfile.mkdtemp(prefix="bench-api-load-"))
        self.redis_port, self.api_port = _free_port(), _free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.redis = subprocess.Popen(
            [exe, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--logfile", "redis.log",
             "--maxclients", "10000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.redis_port, socket_connect_timeout=0.2)
        _wait(client.ping, self.redis, "redis-server")
        self.redis_version = client.info("server")["redis_version"]
        client.close()
        from tests.services.api_server import publish_files

        store = self.dir / "store"
        publish_files(store, "v1")
        env = dict(os.environ, ALIGN_REDIS_URL=self.redis_url, ALIGN_API_TOKEN=TOKEN,
                   ALIGN_STORE_DIR=str(store), ALIGN_API_HOST="127.0.0.1",
                   ALIGN_API_PORT=str(self.api_port), ALIGN_MAX_BODY_BYTES=str(max_body),
                   ALIGN_MAX_GUIDANCE_BODY_BYTES=str(max_body), OMP_NUM_THREADS="1")
        self.api_log = open(self.dir / "api.log", "wb")  # noqa: SIM115 (closed in close())
        self.api = subprocess.Popen([sys.executable, "-m", "alignd.api.main"], env=env,
                                    stdout=self.api_log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.api_port}"
        _wait(lambda: httpx.get(self.url + "/readyz", timeout=1).status_code == 200, self.api,
              "the API")
        r = httpx.post(self.url + "/v1/versions", json={"version_id": "v1"},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        if r.status_code != 201:
            raise SystemExit(f"publishing v1 failed: {r.status_code} {r.text}")

    @property
    def limits(self) -> str:
        from alignd.infra.settings import ApiSettings

        s = ApiSettings(dev_mode=True)
        return (f"header deadline {s.api_header_timeout_s:g} s, keep-alive {s.api_keep_alive_s:g} s, "
                f"503 beyond {s.api_max_connections} connections, backlog {s.api_backlog}, "
                f"{s.heavy_read_concurrency} heavy reads at once, status cache {s.status_cache_s:g} s")

    def log_lines(self) -> int:
        self.api_log.flush()
        return len((self.dir / "api.log").read_bytes().splitlines())

    def close(self) -> None:
        for p in (self.api, self.redis):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.api_log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _rollout(rid: str) -> dict:
    lp = [-0.5 - 0.01 * (i % 50) for i in range(COMPLETION)]
    return {"rollout_id": rid, "prompt_len": 8, "tokens": list(range(8 + COMPLETION)),
            "logprobs": lp, "path": "nvfp4_minite"}


async def _client(phase: str, c: int, http: httpx.AsyncClient, until: float, record: bytes,
                  lat: list[float], errors: list[int], stored: dict[int, int]) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    i = 0
    while time.perf_counter() < until:
        if phase == "GET /healthz":
            req = http.build_request("GET", "/healthz")
        elif phase == "GET /v1/status":
            req = http.build_request("GET", "/v1/status", headers=auth)
        elif phase == "POST rollouts":
            req = http.build_request("POST", "/v1/versions/v1/rollouts", headers=auth,
                                     json={"rollouts": [_rollout(f"c{c}-{i}")]})
        elif phase == "POST scores":
            n = max(stored.get(c, 0), 1)
            r = _rollout(f"c{c}-{i % n}")
            req = http.build_request("POST", "/v1/versions/v1/scores", headers=auth, json={
                "scores": [{"rollout_id": r["rollout_id"], "path": f"bf16-{i // n}",
                            "logprobs": [x - 0.01 for x in r["logprobs"]]}]})
        elif phase == "PUT guidance":
            req = http.build_request("PUT", f"/v1/guidance/v1/g{c}-{i % GUIDANCE_IDS}",
                                     headers={**auth, "Content-Type": "application/octet-stream"},
                                     content=record)
        else:  # the ids this client put in the previous phase
            n = max(min(stored.get(-1 - c, 0), GUIDANCE_IDS), 1)
            req = http.build_request("GET", f"/v1/guidance/v1/g{c}-{i % n}", headers=auth)
        t0 = time.perf_counter()
        try:
            resp = await http.send(req)
            await resp.aread()
            ok = 200 <= resp.status_code < 300
        except httpx.HTTPError:
            ok = False
        lat.append(time.perf_counter() - t0)
        if not ok:
            errors.append(1)
        elif phase == "POST rollouts":
            stored[c] = stored.get(c, 0) + 1
        elif phase == "PUT guidance":
            stored[-1 - c] = stored.get(-1 - c, 0) + 1
        i += 1


async def _phase(url: str, phase: str, clients: int, seconds: float, record: bytes,
                 stored: dict[int, int]) -> dict:
    lat: list[float] = []
    errors: list[int] = []
    # one AsyncClient (one keep-alive connection) per client: a shared pool of hundreds of
    # connections costs the load generator more than the server
    https = [httpx.AsyncClient(base_url=url, timeout=60.0) for _ in range(clients)]
    try:
        await asyncio.gather(*(h.get("/healthz") for h in https))  # connect first, not counted
        t0 = time.perf_counter()
        until = t0 + seconds
        await asyncio.gather(*(_client(phase, c, h, until, record, lat, errors, stored)
                               for c, h in enumerate(https)))
        took = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(h.aclose() for h in https))
    ms = np.asarray(lat) * 1e3
    return {"endpoint": phase, "requests": len(lat), "errors": len(errors),
            "rps": len(lat) / took, "p50": float(np.percentile(ms, 50)) if len(ms) else float("nan"),
            "p99": float(np.percentile(ms, 99)) if len(ms) else float("nan")}


# --- overload: liveness probes under status loops and half-open connections -------------------


async def _probe_once(host: str, port: int) -> bool:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        answer = await reader.read()
    finally:
        writer.close()
    return answer.startswith(b"HTTP/1.1 200")


async def _probes(url: str, probes: int, seconds: float) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    lat: list[float] = []
    errors = 0
    until = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal errors
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            try:
                ok = await asyncio.wait_for(_probe_once(host, int(port)), 30)
            except (OSError, asyncio.TimeoutError):
                ok = False
            lat.append(time.perf_counter() - t0)
            errors += not ok
            await asyncio.sleep(0.01)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(probes)))
    took = time.perf_counter() - t0
    ms = np.asarray(lat) * 1e3
    return {"requests": len(lat), "errors": errors, "rps": len(lat) / took,
            "p50": float(np.percentile(ms, 50)) if len(ms) else float("nan"),
            "p99": float(np.percentile(ms, 99)) if len(ms) else float("nan"),
            "max": float(ms.max()) if len(ms) else float("nan")}


def _status_loops(url: str, clients: int, seconds: float, out) -> None:
    """``clients`` keep-alive clients looping on GET /v1/status (a process of its own)."""

    async def main() -> dict:
        codes: dict[int, int] = {}
        until = time.perf_counter() + seconds
        auth = {"Authorization": f"Bearer {TOKEN}"}

        async def loop(http: httpx.AsyncClient) -> None:
            while time.perf_counter() < until:
                try:
                    code = (await http.get("/v1/status", headers=auth)).status_code
                except httpx.HTTPError:
                    code = 0
                codes[code] = codes.get(code, 0) + 1

        https = [httpx.AsyncClient(base_url=url, timeout=60.0) for _ in range(clients)]
        try:
            await asyncio.gather(*(loop(h) for h in https))
        finally:
            await asyncio.gather(*(h.aclose() for h in https))
        return codes

    out.put(asyncio.run(main()))


def _half_open(url: str, count: int, per_s: float, out) -> None:
    """Open ``count`` connections at ``per_s`` a second, each sending half a request head;
    keep each until the server closes it (a process of its own)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sel = selectors.DefaultSelector()
    opened = refused = closed = 0

    def reap(timeout: float) -> None:
        nonlocal closed
        for key, _ in sel.select(timeout):
            try:
                data = key.fileobj.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                closed += 1

    t0 = time.monotonic()
    for i in range(count):
        wait = t0 + i / per_s - time.monotonic()
        if wait > 0:
            reap(wait)
        try:
            s = socket.socket()
        except OSError:  # this process is out of descriptors: the server keeps them all
            refused += count - i
            break
        s.settimeout(5)
        try:
            s.connect((host, int(port)))
            s.sendall(PARTIAL_HEAD)
        except OSError:
            refused += 1
            s.close()
            continue
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        opened += 1
    open_s = time.monotonic() - t0
    until = time.monotonic() + 15  # the rest end at the header deadline
    while sel.get_map() and time.monotonic() < until:
        reap(0.2)
    left = len(sel.get_map())
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    out.put({"opened": opened, "refused": refused, "closed_by_server": closed, "left": left,
             "open_s": open_s})


def overload(stack: _Stack, probes: int, seconds: float, status_clients: int, half_open: int,
             rate: float) -> tuple[list[dict], dict, dict]:
    """The three probe phases (rows of the table), the status loops' codes, the flood's counts."""
    ctx = mp.get_context("fork")
    rows = [{"endpoint": OVERLOAD[0], **asyncio.run(_probes(stack.url, probes, seconds))}]
    out = ctx.Queue()
    loader = ctx.Process(target=_status_loops, args=(stack.url, status_clients, seconds + 1, out))
    loader.start()
    time.sleep(1.0)
    rows.append({"endpoint": OVERLOAD[1], **asyncio.run(_probes(stack.url, probes, seconds))})
    codes = out.get(timeout=seconds + 120)
    loader.join(30)
    flood_s = half_open / rate
    flood = ctx.Process(target=_half_open, args=(stack.url, half_open, rate, out))
    flood.start()
    rows.append({"endpoint": OVERLOAD[2], **asyncio.run(_probes(stack.url, probes, flood_s))})
    counts = out.get(timeout=flood_s + 180)
    flood.join(30)
    return rows, codes, counts


def register_versions(redis_url: str, n: int) -> None:
    """``n`` more versions in the API's registry (every tenth walked to serving)."""
    from alignd.infra.bus import RedisBus, connect
    from alignd.infra.registry import Registry
    from alignd.infra.settings import ApiSettings

    registry = Registry(RedisBus(connect(redis_url)), ApiSettings(dev_mode=True).key_prefix)
    for i in range(n):
        vid = f"load{i:05d}"
        registry.create(vid, f"/published/{vid}", actor="bench")
        if i % 10 == 0:
            for state in ("converting", "converted", "loading", "serving"):
                registry.transition(vid, state, actor="bench")


# --- the guidance store under several learners ----------------------------------------------


def _store(url: str):
    from alignd.infra.stores.guidance import GuidanceStore

    return GuidanceStore(url, prefix="bench", budget_bytes=None, ttl_s=None)


def _learner(url: str, ids: list[str], until: float, out) -> None:
    store = _store(url)
    got = calls = 0
    while time.time() < until:
        recs = store.get_many("gv", ids)
        got += sum(len(r) for r in recs.values())
        calls += 1
    store.close()
    out.put(("read", got, calls))


def _writer(url: str, batch: int, size: int, until: float, out) -> None:
    store = _store(url)
    blob = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    put = calls = 0
    while time.time() < until:
        store.put_many("gv", {f"w{calls % 4}-{j}": blob for j in range(batch)})
        put += batch * size
        calls += 1
    store.close()
    out.put(("write", put, calls))


def store_load(url: str, learners: int, batch: int, size: int, seconds: float) -> dict:
    """``learners`` processes get_many a batch while one writer put_many's; MB/s of each side."""
    store = _store(url)
    blob = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    ids = [f"r{j}" for j in range(batch)]
    store.put_many("gv", dict.fromkeys(ids, blob))
    store.close()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    until = time.time() + seconds
    procs = [ctx.Process(target=_learner, args=(url, ids, until, out)) for _ in range(learners)]
    procs.append(ctx.Process(target=_writer, args=(url, batch, size, until, out)))
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    took = time.perf_counter() - t0
    read = sum(b for k, b, _ in results if k == "read")
    wrote = sum(b for k, b, _ in results if k == "write")
    return {"learners": learners, "seconds": took, "read_mb_s": read / took / 1e6,
            "write_mb_s": wrote / took / 1e6,
            "get_many_calls": sum(n for k, _, n in results if k == "read"),
            "put_many_calls": sum(n for k, _, n in results if k == "write")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_api_load", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="50 clients for 10 s")
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None, help="all HTTP phases together")
    ap.add_argument("--record-kib", type=int, default=16)
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--learner-record-kib", type=int, default=1024)
    ap.add_argument("--store-seconds", type=float, default=None)
    ap.add_argument("--versions", type=int, default=2_000, help="registered before overload")
    ap.add_argument("--probes", type=int, default=4, help="concurrent liveness probes")
    ap.add_argument("--overload-seconds", type=float, default=None)
    ap.add_argument("--status-clients", type=int, default=40)
    ap.add_argument("--half-open", type=int, default=None)
    ap.add_argument("--half-open-rate", type=float, default=1_000.0)
    args = ap.parse_args(argv)
    overload_s = args.overload_seconds or (5.0 if args.quick else 10.0)
    half_open = args.half_open or (5_000 if args.quick else 20_000)
    clients = args.clients or (50 if args.quick else 200)
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    store_seconds = args.store_seconds or (3.0 if args.quick else 10.0)
    record = np.random.default_rng(0).integers(0, 256, args.record_kib << 10, dtype=np.uint8).tobytes()
    stack = _Stack(max_body=max(4 << 20, 2 * len(record)))
    try:
        print(f"redis {stack.redis_version}, API {stack.url} (1 uvicorn worker, separate process), "
              f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {clients} clients, "
              f"{seconds:g} s over {len(PHASES)} phases", flush=True)
        stored: dict[int, int] = {}
        rows = [asyncio.run(_phase(stack.url, p, clients, seconds / len(PHASES), record, stored))
                for p in PHASES]
        register_versions(stack.redis_url, args.versions)
        more, codes, flood = overload(stack, args.probes, overload_s, args.status_clients,
                                      half_open, args.half_open_rate)
        rows += more
        base = rows[0]
        print(f"\n{'endpoint':<18} {'requests':>9} {'errors':>7} {'req/s':>9} {'p50 ms':>8} "
              f"{'p99 ms':>8} {'req/s vs healthz':>17} {'p50 vs healthz':>15}")
        for r in rows:
            print(f"{r['endpoint']:<18} {r['requests']:>9} {r['errors']:>7} {r['rps']:>9.0f} "
                  f"{r['p50']:>8.1f} {r['p99']:>8.1f} {r['rps'] / base['rps']:>17.2f} "
                  f"{r['p50'] / base['p50']:>15.2f}")
        print(f"(guidance records {args.record_kib} KiB; rollouts of {COMPLETION} completion tokens)")
        print(f"overload phases at {args.versions + 1} versions, {overload_s:g} s, {args.probes} "
              f"probes (a new connection per GET /healthz); probe max ms: "
              + ", ".join(f"{r['endpoint']} {r['max']:.0f}" for r in more))
        print(f"  {args.status_clients} status clients: {sum(codes.values())} answers {codes}")
        print(f"  half-open: {flood['opened']} opened in {flood['open_s']:.1f} s "
              f"({flood['refused']} not opened), {flood['closed_by_server']} closed by the server, "
              f"{flood['left']} still open 15 s later; API log {stack.log_lines()} lines in all")
        print(f"  API limits: {stack.limits}")
        s = store_load(stack.redis_url, args.learners, args.batch, args.learner_record_kib << 10,
                       store_seconds)
        print(f"\nguidance store, {s['learners']} learner processes get_many({args.batch} x "
              f"{args.learner_record_kib} KiB) + 1 writer put_many, {s['seconds']:.1f} s: "
              f"read {s['read_mb_s']:.0f} MB/s ({s['get_many_calls']} calls), "
              f"write {s['write_mb_s']:.0f} MB/s ({s['put_many_calls']} calls)")
        return 1 if any(r["requests"] == 0 for r in rows) else 0
    finally:
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
