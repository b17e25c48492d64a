#!/usr/bin/env python3
"""Container health check of the libalign services (installed as ``align-healthcheck``).

Exit status 0 means healthy, 1 unhealthy; one line on stdout says why. Three modes:

* ``--url URL``: GET the URL, healthy on a 2xx answer within ``--timeout`` seconds;
* ``--heartbeat SERVICE``: healthy while a heartbeat of ``SERVICE`` written from this
  host (the container's host name) exists in Redis and is not ``stopped``; for services
  without an HTTP server (the embedded learner). Redis and the key prefix come from
  ``ALIGN_REDIS_URL`` and ``ALIGN_KEY_PREFIX`` as the service reads them;
* neither: ``http://127.0.0.1:$ALIGN_METRICS_PORT/healthz`` when ``ALIGN_METRICS_PORT`` is
  set (converter, sampler), else the API's ``http://127.0.0.1:$ALIGN_API_PORT/readyz``.

Only the standard library is imported for HTTP, so a check costs a few tens of ms.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import urllib.error
import urllib.request


def default_url(env: dict[str, str]) -> str:
    """The URL a service configured by ``env`` answers health checks on."""
    metrics_port = env.get("ALIGN_METRICS_PORT", "").strip()
    if metrics_port:
        return f"http://127.0.0.1:{metrics_port}/healthz"
    return f"http://127.0.0.1:{env.get('ALIGN_API_PORT', '').strip() or '8000'}/readyz"


def check_url(url: str, timeout: float) -> tuple[bool, str]:
    """``(healthy, reason)`` of one GET."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300, f"{url}: HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"


def check_heartbeat(service: str, env: dict[str, str], timeout: float,
                    host: str | None = None) -> tuple[bool, str]:
    """``(healthy, reason)``: a live heartbeat of ``service`` from ``host`` (default: this one)."""
    import redis  # this mode only: a URL check stays stdlib-only (redis-py adds ~0.3 s a check)

    url = env.get("ALIGN_REDIS_URL", "").strip()
    if not url:
        return False, "ALIGN_REDIS_URL is not set (the embedded Redis is not visible from here)"
    prefix = env.get("ALIGN_KEY_PREFIX", "").strip() or "libalign"
    host = host or socket.gethostname()
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                  decode_responses=True)
    try:
        seen = []
        for key in client.scan_iter(match=f"{prefix}:heartbeat:{service}:*", count=500):
            beat_host, state = client.hmget(key, "host", "state")
            if beat_host != host:
                continue
            seen.append(f"{key.rsplit(':', 1)[-1]} {state}")
            if state and state != "stopped":
                return True, f"{service} {key.rsplit(':', 1)[-1]} on {host}: {state}"
    except redis.RedisError as e:
        return False, f"Redis: {e}"
    finally:
        client.close()
    return False, f"no live {service} heartbeat from {host}" + (f" ({', '.join(seen)})" if seen else "")


def main(argv: list[str] | None = None, env: dict[str, str] | None = None) -> int:
    """Run one check; exit status 0 healthy, 1 not."""
    ap = argparse.ArgumentParser(prog="align-healthcheck", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--url", help="GET this URL (default: from ALIGN_METRICS_PORT / ALIGN_API_PORT)")
    mode.add_argument("--heartbeat", metavar="SERVICE",
                      help="a live Redis heartbeat of SERVICE from this host")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds before giving up")
    args = ap.parse_args(argv)
    env = dict(os.environ) if env is None else env
    if args.heartbeat:
        ok, why = check_heartbeat(args.heartbeat, env, args.timeout)
    else:
        ok, why = check_url(args.url or default_url(env), args.timeout)
    print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
