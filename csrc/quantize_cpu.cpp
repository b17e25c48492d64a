// CPU kernel of libalign.spec.quantize for the te / torchao / modelopt orders and MXFP4.
//
// One pass per row: the row is widened to fp32 into a small per-thread buffer while the
// block maxima and the row maximum are taken, then every block gets its E4M3 scale and
// its 16 elements are encoded and packed (the driver: quantize_cpu_rows.h). MXFP4 rows
// share the load and the encode, with an E8M0 byte and a power-of-two multiplier per 32
// values (mx_scale_blocks). Rows are split across std::threads.
//
// Three instruction-set paths, all in this one library, chosen at run time:
//   scalar  portable C++, the reference the others are checked against;
//   avx2    AVX2 + F16C, a block of 16 values in two registers (quantize_cpu_avx2.h);
//   avx512  AVX512F/BW/VL/DQ, a block in one register (quantize_cpu_avx512.h).
// The library is built for the baseline x86-64 (no -march): each SIMD path is compiled
// inside its own `#pragma GCC target` region, and nvfp4_cpu_set_path picks the best one
// the CPU supports (__builtin_cpu_supports, which also checks that the OS saves the wide
// registers), so a cached library runs on any x86-64 host. A 4-over-6 block (encoded twice,
// its two errors summed in a fixed element order) takes the shared scalar steps on the
// scalar path and the path's registers on AVX2 and AVX-512, the sums in scalar. A path can be forced for
// tests and benchmarks; one the CPU lacks is refused. Every path is checked bit for bit
// against the spec (tests/libalign/test_ops_kernels.py).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "nvfp4_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NV_X86 1
#else
#define NV_X86 0
#endif

namespace {

inline float load_scalar(const void* x, int64_t i, int dtype) {
  if (dtype == NV_IN_FP32) return static_cast<const float*>(x)[i];
  uint16_t h = static_cast<const uint16_t*>(x)[i];
  if (dtype == NV_IN_BF16) return nv_u2f(static_cast<uint32_t>(h) << 16);
  // IEEE half -> float, exact
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return nv_u2f(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    float v = static_cast<float>(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -v : v;
  }
  return nv_u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

inline bool finite_bits(float v) { return (nv_f2u(v) & 0x7F800000u) != 0x7F800000u; }

inline float saturate_value(float v, float in_max) {
  if (v != v) return 0.0f;
  return v > 0 ? in_max : -in_max;
}

// A block holding NaN/Inf, widened in dst: flag it (maximum 0), or saturate its
// non-finite values (nonfinite='saturate') and return its maximum. Shared by all paths.
inline float nonfinite_block(float* dst, const NvParams& p, int* flags, float* vmax_b) {
  if (!p.nonfinite_saturate) {
    *flags |= NV_FLAG_NONFINITE;
    *vmax_b = 0.0f;
    return 0.0f;
  }
  float m = 0.0f;
  for (int i = 0; i < 16; ++i) {
    if (!finite_bits(dst[i])) dst[i] = saturate_value(dst[i], p.in_max);
    m = std::max(m, fabsf(dst[i]));
  }
  *vmax_b = m;
  return m;
}

// The outer scales of row r: from its maximum (row domain, which also writes the
// row's floored maximum and stored value), or the given per-tensor/per-expert ones.
inline NvOuter row_outer(float rowmax, const NvParams& p, int64_t r, int64_t e,
                         const float* enc, const float* dec, float* amax_out,
                         float* stored_out) {
  NvOuter o;
  if (p.outer_mode == NV_OUTER_ROW) {
    float a = rowmax;
    if (p.has_amax_floor) a = nv_max(a, p.amax_floor);
    o = nv_outer_from_amax(a, p.op_order, p.e4m3_max);
    amax_out[r] = a;
    stored_out[r] = nv_stored(a, o, p);
  } else {
    const int64_t i = p.outer_stride ? e : 0;
    o.enc = enc[i];
    o.dec = dec[i];
  }
  return o;
}

// Rows handed out in chunks: a worker takes the next chunk when it finishes one, so a
// worker slowed by other load on its core takes fewer rows instead of holding up the call.
class RowQueue {
 public:
  RowQueue(int64_t total, int64_t chunk) : total_(total), chunk_(chunk) {}
  bool take(int64_t* r0, int64_t* r1) {
    const int64_t a = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (a >= total_) return false;
    *r0 = a;
    *r1 = std::min(total_, a + chunk_);
    return true;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t total_, chunk_;
};

// Row r's scale bytes into the linear or 128x4-swizzled layout.
inline void store_scales(const uint8_t* sbytes, uint8_t* scales, const NvParams& p, int64_t r,
                         int64_t e, int64_t rr, int64_t nb) {
  if (p.swizzled) {
    uint8_t* base = scales + nv_swizzle_row_base(e, rr, p.rows, nb);
    for (int64_t b = 0; b < nb; ++b) base[nv_swizzle_col(b)] = sbytes[b];
  } else {
    memcpy(scales + r * nb, sbytes, static_cast<size_t>(nb));
  }
}

// MXFP4 scales of one row from its 16-value block maxima vmax (nb of them, nb even): the
// E8M0 byte of each 32-value block (the larger of its two halves' maxima is its maximum)
// and its multiplier, written for both halves (mult[2j], mult[2j + 1]). A few scalar
// operations per 32 values, the same on every path.
inline void mx_scale_blocks(const float* vmax, int64_t nb, int order, uint8_t* sbytes,
                            float* mult) {
  for (int64_t j = 0; j < nb / 2; ++j) {
    const uint32_t b = nv_e8m0_byte(std::max(vmax[2 * j], vmax[2 * j + 1]), order);
    sbytes[j] = static_cast<uint8_t>(b);
    mult[2 * j] = mult[2 * j + 1] = nv_mx_mult(b, order);
  }
}

}  // namespace

// --- scalar: the operations of nvfp4_math.h one element at a time ---------------------------
namespace nv_scalar {
namespace {

float load_row(const void* x, int64_t base, int64_t k, int dtype, const NvParams& p,
               float* buf, float* vmax, int* flags) {
  const int64_t nb = k / 16;
  float rowmax = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    float* dst = buf + b * 16;
    bool bad = false;
    for (int i = 0; i < 16; ++i) {
      dst[i] = load_scalar(x, base + b * 16 + i, dtype);
      bad |= !finite_bits(dst[i]);
    }
    if (bad) {
      rowmax = std::max(rowmax, nonfinite_block(dst, p, flags, vmax + b));
      continue;
    }
    float m = 0.0f;
    for (int i = 0; i < 16; ++i) m = std::max(m, fabsf(dst[i]));
    vmax[b] = m;
    rowmax = std::max(rowmax, m);
  }
  return rowmax;
}

void scale_blocks(const float* vmax, int64_t nb, NvOuter o, float te_mult, const NvParams& p,
                  uint8_t* sbytes, float* mult, float* div, int* undefined) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t sb = nv_block_scale(vmax[b], o, te_mult, p, undefined);
    const NvEnc e = nv_element_encoder(nv_e4m3_value(sb), o, p);
    sbytes[b] = sb;
    mult[b] = e.mult;
    div[b] = e.div;
  }
}

inline void encode_block(const float* xb, NvEnc e, int signed_zero, uint8_t* out) {
  for (int i = 0; i < 8; ++i) {
    uint32_t lo = nv_e2m1_code(xb[2 * i], e, signed_zero);
    uint32_t hi = nv_e2m1_code(xb[2 * i + 1], e, signed_zero);
    out[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

inline float row_max16(const void*, int64_t, int64_t, int) { return -1.0f; }  // load_row's

// One 4-over-6 block in the shared scalar steps of nvfp4_math.h (nv_fos_block): its E4M3
// byte, its 8 packed code bytes in out.
inline uint8_t fos_block(const float* xb, float v, NvOuter o, float amax, const NvParams& p,
                         uint8_t* out) {
  uint64_t packed;
  const uint8_t sb = nv_fos_block(xb, v, o, amax, p, &packed);
  for (int j = 0; j < 8; ++j) out[j] = static_cast<uint8_t>(packed >> (8 * j));
  return sb;
}

#include "quantize_cpu_rows.h"

}  // namespace
}  // namespace nv_scalar

#if NV_X86
// --- AVX2 + F16C ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace nv_avx2 {
namespace {
#include "quantize_cpu_avx2.h"
#include "quantize_cpu_rows.h"
}  // namespace
}  // namespace nv_avx2
#pragma GCC pop_options

// --- AVX-512 -------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512dq")
namespace nv_avx512 {
namespace {
#include "quantize_cpu_avx512.h"
#include "quantize_cpu_rows.h"
}  // namespace
}  // namespace nv_avx512
#pragma GCC pop_options
#endif

namespace {

int detect_paths() {
  int mask = 1 << NV_CPU_SCALAR;
#if NV_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (avx2) mask |= 1 << NV_CPU_AVX2;
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    mask |= 1 << NV_CPU_AVX512;
#endif
  return mask;
}

int supported_paths() {
  static const int mask = detect_paths();
  return mask;
}

int best_path() {  // the highest supported: each path's CPU needs include the one's below
  const int mask = supported_paths();
  int best = NV_CPU_SCALAR;
  for (int p = NV_CPU_SCALAR; p <= NV_CPU_AVX512; ++p)
    if ((mask >> p) & 1) best = p;
  return best;
}

std::atomic<int> g_path{-1};  // -1: the best supported path

int current_path() {
  const int p = g_path.load(std::memory_order_relaxed);
  return p < 0 ? best_path() : p;
}

void quantize_rows(int path, const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                   float* stored_out, const float* enc, const float* dec, const NvParams& p,
                   RowQueue& q, int* flags) {
#if NV_X86
  if (path == NV_CPU_AVX512)
    return nv_avx512::quantize_rows(x, codes, scales, amax_out, stored_out, enc, dec, p, q, flags);
  if (path == NV_CPU_AVX2)
    return nv_avx2::quantize_rows(x, codes, scales, amax_out, stored_out, enc, dec, p, q, flags);
#endif
  (void)path;
  nv_scalar::quantize_rows(x, codes, scales, amax_out, stored_out, enc, dec, p, q, flags);
}

void amax_rows(int path, const void* x, const NvParams& p, RowQueue& q, float* part, int* flags) {
#if NV_X86
  if (path == NV_CPU_AVX512) return nv_avx512::amax_rows(x, p, q, part, flags);
  if (path == NV_CPU_AVX2) return nv_avx2::amax_rows(x, p, q, part, flags);
#endif
  (void)path;
  nv_scalar::amax_rows(x, p, q, part, flags);
}

// Run fn(queue, worker) on up to nthreads workers (the calling thread is worker 0), at least
// 64 rows each, sharing one queue of chunks of about 1/16 of a worker's share.
template <typename F>
void parallel_rows(int64_t total, int nthreads, F fn) {
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, total / 64)));
  RowQueue q(total, std::max<int64_t>(1, total / (16 * t)));
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i) pool.emplace_back([&q, &fn, i] { fn(q, i); });
  fn(q, 0);
  for (auto& th : pool) th.join();
}

}  // namespace

extern "C" {

int nvfp4_cpu_supported_paths(void) { return supported_paths(); }

int nvfp4_cpu_path(void) { return current_path(); }

int nvfp4_cpu_set_path(int path) {
  if (path < 0) { g_path.store(-1); return 0; }
  if (path > NV_CPU_AVX512 || !((supported_paths() >> path) & 1)) return -1;
  g_path.store(path);
  return 0;
}

int nvfp4_quantize_cpu(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                       float* stored_out, const float* enc, const float* dec,
                       const NvParams* p, int nthreads) {
  if (p->k % (NV_IS_MX(p->op_order) ? 32 : 16) != 0) return -1;
  if (p->gather) {  // each expert's rows from its own pointer, outputs as for one stack
    if (NV_IS_MX(p->op_order) || p->outer_mode != NV_OUTER_ROW || p->swizzled) return -3;
    NvParams one = *p;
    one.experts = 1;
    one.gather = nullptr;
    const int64_t rk = p->rows * p->k;
    int out = 0;
    for (int64_t e = 0; e < p->experts && !(out & NV_FLAG_NONFINITE); ++e)
      out |= nvfp4_quantize_cpu(p->gather[e], codes + e * (rk / 2), scales + e * (rk / 16),
                                amax_out + e * p->rows, stored_out + e * p->rows, enc, dec, &one,
                                nthreads);
    return out;
  }
  const int64_t total = p->experts * p->rows;
  const int path = current_path();
  std::vector<int> flags(static_cast<size_t>(std::max(1, nthreads)), 0);
  parallel_rows(total, nthreads, [&](RowQueue& q, int i) {
    quantize_rows(path, x, codes, scales, amax_out, stored_out, enc, dec, *p, q, &flags[i]);
  });
  int out = 0;
  for (int f : flags) out |= f;
  return out;
}

int nvfp4_amax_cpu(const void* x, float* amax_out, const NvParams* p, int nthreads) {
  if (p->k % (NV_IS_MX(p->op_order) ? 32 : 16) != 0) return -1;
  if (p->gather) return -3;
  const int64_t total = p->experts * p->rows;
  const int nt = std::max(1, nthreads), path = current_path();
  std::vector<float> part(static_cast<size_t>(nt * p->experts), 0.0f);
  std::vector<int> flags(static_cast<size_t>(nt), 0);
  parallel_rows(total, nt, [&](RowQueue& q, int i) {
    amax_rows(path, x, *p, q, part.data() + static_cast<size_t>(i * p->experts), &flags[i]);
  });
  int out = 0;
  for (int f : flags) out |= f;
  for (int64_t e = 0; e < p->experts; ++e) {
    float m = 0.0f;
    for (int i = 0; i < nt; ++i) m = std::max(m, part[static_cast<size_t>(i * p->experts + e)]);
    amax_out[e] = m;
  }
  return out;
}

}  // extern "C"
