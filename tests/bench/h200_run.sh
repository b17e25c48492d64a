#!/usr/bin/env bash
# One lent-H200 call: GPU tests and benchmarks, logs under $OUT (the device machine keeps nothing).
#   tests/bench/h200_run.sh STAGE [STAGE ...]    stages: tests, gemm, convert, megatron, strict,
#                                               records (kv_guidance + routing + guidance on cuda),
#                                               mxfp4, probe (profile_convert --timeline),
#                                               gemmprobe (profile_gemm: eager host time),
#                                               refit (bench_refit: NVFP4 vs BF16 refit by CUDA IPC),
#                                               recipes (bench_spec --recipes: kernel door vs spec),
#                                               tiles (probe_strict_tiles: strict tile shapes and
#                                               attention settings, time and bits),
#                                               host (probe_strict_host: host time per strict call),
#                                               layer (probe_strict_layer: a 30B-shaped layer's
#                                               host time, launches and waits, normal and strict),
#                                               fill (probe_fill_host: the refit producer's host
#                                               time per weight, stacked runs against one launch
#                                               a weight), roofline (probe_convert_cuda --roofline:
#                                               the converter's kernel variants against the copy
#                                               and against kernels of the same traffic),
#                                               fused (probe_w4a4_fused: the W4A4 GEMM quantizing
#                                               activations in its load, against today's two steps)
# Wheels the image lacks travel in .whl/ (git-ignored; carry it): megatron-core and torchao, and
# for the services the expert-parallel tests import, redis, httpx (+ httpcore, h11, anyio,
# certifi, idna), pydantic(-core, -settings, annotated-types, typing-inspection,
# typing-extensions), python-dotenv, rich (+ pygments, markdown-it-py, mdurl), click, tenacity
# and safetensors: `pip download --no-deps -d .whl NAME==VERSION`, with `--only-binary=:all:
# --platform manylinux2014_x86_64 --python-version 3.12` for the compiled ones. Each stage has
# its own time limit so one that hangs leaves the others their share of the call.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/h200_out}"; mkdir -p "$OUT"
[ -d .h20cache/models ] && export ALIGN_MODEL_CACHE="$PWD/.h20cache/models"   # trained tiny models
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD:$PWD/clients:$PWD/services" || exit 1
else
  export PYTHONPATH="$PWD:$PWD/clients:$PWD/services"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/smi.csv"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
      torch.cuda.get_device_name())' | tee "$OUT/versions.txt"

stage() {   # name, limit in seconds, command...
  local name="$1" limit="$2"; shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

for s in "$@"; do
  case "$s" in
    tests) stage tests "${T_TESTS:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu \
             --maxfail=15 --continue-on-collection-errors -o addopts="-rfE" ${TEST_FILES:-tests/libalign} ;;
    gemm) stage gemm "${T_GEMM:-200}" python3 -m tests.bench gemm -- ${GEMM_ARGS:---profile} ;;
    convert) stage convert "${T_CONVERT:-150}" python3 -m tests.bench convert -- \
               --layers "${CONVERT_LAYERS:-48}" --json "$OUT/convert.json" ;;
    megatron) stage megatron "${T_MEGATRON:-200}" python3 -m tests.bench megatron -- \
                --json "$OUT/megatron.json" ;;
    strict) stage strict "${T_STRICT:-200}" python3 -m tests.bench strict -- --device cuda ${STRICT_ARGS:-} ;;
    records) stage kv_guidance "${T_RECORDS:-60}" python3 -m tests.bench kv_guidance -- \
               --device cuda --no-learner
             stage routing "${T_RECORDS:-60}" python3 -m tests.bench routing -- --device cuda --no-learner
             stage guidance "${T_RECORDS:-60}" python3 -m tests.bench guidance -- --device cuda ;;
    mxfp4) stage mxfp4 "${T_MXFP4:-60}" python3 -m tests.bench mxfp4 -- --device cuda ;;
    probe) stage probe "${T_PROBE:-60}" python3 -m tests.bench.profile_convert --timeline ;;
    refit) stage refit "${T_REFIT:-240}" python3 -m tests.bench refit -- --device cuda \
             --json "$OUT/refit.json" ${REFIT_ARGS:-} ;;
    gemmprobe) stage gemmprobe "${T_PROBE:-60}" python3 -m tests.bench.profile_gemm ;;
    recipes) stage recipes "${T_RECIPES:-90}" python3 -m tests.bench spec -- --recipes \
               --device cuda --json "$OUT/recipes.json" ;;
    tiles) stage tiles "${T_TILES:-150}" python3 -m tests.bench.probe_strict_tiles ${TILES_ARGS:-} ;;
    host) stage host "${T_HOST:-60}" python3 -m tests.bench.probe_strict_host ;;
    layer) stage layer "${T_LAYER:-120}" python3 -m tests.bench.probe_strict_layer ;;
    fill) stage fill "${T_FILL:-90}" python3 -m tests.bench.probe_fill_host --device cuda ${FILL_ARGS:-} \
            --rows 768 --cols 2048 ;;
    roofline) stage roofline "${T_ROOFLINE:-120}" python3 -m tests.bench.probe_convert_cuda \
                ${ROOFLINE_ARGS:-minite} --roofline ;;
    fused) stage fused "${T_FUSED:-150}" python3 -m tests.bench.probe_w4a4_fused ;;
    *) echo "unknown stage $s" >&2 ;;
  esac
done
