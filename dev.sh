#!/usr/bin/env bash
# The project's one entry point for set-up and the main jobs.
#   ./dev.sh demo    main job on the embedded default (no Redis, no GPU)
#   ./dev.sh test    the whole test suite (ruff + pytest), what CI runs (installs redis-server,
#                    chromium and prometheus when missing)
#   ./dev.sh bench   benchmarks under tests/bench (prints ratio tables)
# It creates .venv (or $ALIGN_VENV) and installs what the job needs on first use.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${ALIGN_VENV:-.venv}"
TORCH_REQ="${ALIGN_TORCH:-torch==2.13.0}"   # CPU build on the project's machines

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

apt_install() {
  command -v apt-get >/dev/null || { echo "dev.sh: please install: $*" >&2; return 1; }
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_venv() {   # $1: pip extra of libalign ("demo" or "test"); the client is installed beside it
  local extra="$1" stamp
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" 2>/dev/null || { apt_install python3-venv python3-dev && python3 -m venv "$VENV"; }
  fi
  stamp="$VENV/.libalign-${extra:-base}-$(cat pyproject.toml clients/pyproject.toml setup.py | sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_REQ"
  "$VENV/bin/python" -m pip install -q -e ./clients -e ".${extra:+[$extra]}"
  touch "$stamp"
}

ensure_sglang_cpu() {   # SGLang's layer classes for the CPU tests, beside the venv, never in it
  local req=tests/services/sglang_cpu.txt dir="$VENV/sglang-cpu" stamp
  stamp="$dir/.stamp-$(sha256sum < "$req" | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  rm -rf "$dir"
  "$VENV/bin/python" -m pip install -q --no-deps --target "$dir" -r "$req" && touch "$stamp"
}

ensure_verl_cpu() {   # verl's source files for the peer tests, beside the venv, never imported whole
  local req=tests/services/verl_cpu.txt dir="$VENV/verl-cpu" stamp
  stamp="$dir/.stamp-$(sha256sum < "$req" | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  rm -rf "$dir"
  "$VENV/bin/python" -m pip install -q --no-deps --target "$dir" -r "$req" && touch "$stamp"
}

cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo)  ensure_venv demo;   exec "$VENV/bin/alignd" demo "$@" ;;
  test)  ensure_venv test
         ensure_sglang_cpu \
           || echo "dev.sh: SGLang did not install; tests/services/test_sglang_quant.py will be skipped" >&2
         ensure_verl_cpu \
           || echo "dev.sh: verl did not install; its comparisons in tests/services/test_importance_peers.py will be skipped" >&2
         command -v redis-server >/dev/null || apt_install redis-server \
           || echo "dev.sh: no redis-server; the Redis service tests will be skipped" >&2
         command -v chromium >/dev/null || command -v chromium-browser >/dev/null || apt_install chromium \
           || echo "dev.sh: no chromium; the status page test will be skipped (in CI it fails)" >&2
         command -v promtool >/dev/null && command -v prometheus >/dev/null || apt_install prometheus \
           || echo "dev.sh: no prometheus/promtool; the monitoring tests will be skipped (in CI they fail)" >&2
         "$VENV/bin/ruff" check .
         exec "$VENV/bin/python" -m pytest "$@" ;;
  bench) ensure_venv test; exec "$VENV/bin/python" -m tests.bench "$@" ;;
  *) echo "usage: $0 {demo|test|bench} [args...]" >&2; exit 2 ;;
esac
