// CPU kernel of libalign.spec.quantize for the te / torchao / modelopt orders.
//
// One pass per row: the row is widened to fp32 into a small per-thread buffer while the
// block maxima and the row maximum are taken, then every block gets its E4M3 scale and
// its 16 elements are encoded and packed. Rows are split across std::threads. With
// AVX-512 the 16 elements of a block are one vector register; otherwise a scalar loop
// does the same operations. Both are checked bit for bit against the spec.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "nvfp4_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define NV_HAVE_AVX512 1
#else
#define NV_HAVE_AVX512 0
#endif

namespace {

std::atomic<int> g_force_scalar{0};

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

// Widen one row to fp32 in buf, fill block maxima, return the row maximum; flags on NaN/Inf.
float load_row(const void* x, int64_t base, int64_t k, int dtype, const NvParams& p,
               float* buf, float* vmax, int* flags) {
  const int64_t nb = k / 16;
  float rowmax = 0.0f;
  bool use_simd = NV_HAVE_AVX512 && !g_force_scalar.load(std::memory_order_relaxed);
  for (int64_t b = 0; b < nb; ++b) {
    float* dst = buf + b * 16;
    bool bad = false;
#if NV_HAVE_AVX512
    if (use_simd) {
      __m512 v;
      if (dtype == NV_IN_BF16) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            static_cast<const uint16_t*>(x) + base + b * 16));
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else if (dtype == NV_IN_FP16) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            static_cast<const uint16_t*>(x) + base + b * 16));
        v = _mm512_cvtph_ps(h);
      } else {
        v = _mm512_loadu_ps(static_cast<const float*>(x) + base + b * 16);
      }
      __m512i bits = _mm512_castps_si512(v);
      __m512i expo = _mm512_and_si512(bits, _mm512_set1_epi32(0x7F800000));
      bad = _mm512_cmpeq_epi32_mask(expo, _mm512_set1_epi32(0x7F800000)) != 0;
      _mm512_storeu_ps(dst, v);
      if (!bad) {
        __m512 a = _mm512_abs_ps(v);
        float m = _mm512_reduce_max_ps(a);
        vmax[b] = m;
        rowmax = std::max(rowmax, m);
        continue;
      }
    } else
#endif
    {
      for (int i = 0; i < 16; ++i) {
        dst[i] = load_scalar(x, base + b * 16 + i, dtype);
        bad |= !finite_bits(dst[i]);
      }
    }
    if (bad) {
      if (!p.nonfinite_saturate) { *flags |= NV_FLAG_NONFINITE; vmax[b] = 0.0f; continue; }
      for (int i = 0; i < 16; ++i)
        if (!finite_bits(dst[i])) dst[i] = saturate_value(dst[i], p.in_max);
    }
    float m = 0.0f;
    for (int i = 0; i < 16; ++i) m = std::max(m, fabsf(dst[i]));
    vmax[b] = m;
    rowmax = std::max(rowmax, m);
  }
  return rowmax;
}

// Encode one block of 16 fp32 values into 8 packed bytes.
inline void encode_block(const float* xb, NvEnc e, int signed_zero, uint8_t* out, bool simd) {
#if NV_HAVE_AVX512
  if (simd) {
    __m512 x = _mm512_loadu_ps(xb);
    __m512 z = e.use_div ? _mm512_div_ps(x, _mm512_set1_ps(e.div))
                         : _mm512_mul_ps(x, _mm512_set1_ps(e.mult));
    z = _mm512_min_ps(_mm512_max_ps(z, _mm512_set1_ps(-6.0f)), _mm512_set1_ps(6.0f));
    __m512 a = _mm512_abs_ps(z);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i mag = _mm512_setzero_si512();
    mag = _mm512_mask_add_epi32(mag, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_GT_OQ), mag, one);
    mag = _mm512_mask_add_epi32(mag, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.75f), _CMP_GE_OQ), mag, one);
    mag = _mm512_mask_add_epi32(mag, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.25f), _CMP_GT_OQ), mag, one);
    mag = _mm512_mask_add_epi32(mag, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.75f), _CMP_GE_OQ), mag, one);
    mag = _mm512_mask_add_epi32(mag, _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.5f), _CMP_GT_OQ), mag, one);
    mag = _mm512_mask_add_epi32(mag, _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.5f), _CMP_GE_OQ), mag, one);
    mag = _mm512_mask_add_epi32(mag, _mm512_cmp_ps_mask(a, _mm512_set1_ps(5.0f), _CMP_GT_OQ), mag, one);
    __mmask16 neg;
    if (signed_zero == NV_SZ_SIGN_OF_INPUT)
      neg = _mm512_movepi32_mask(_mm512_castps_si512(z));
    else if (signed_zero == NV_SZ_SIGN_OF_NONZERO)
      neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
    else
      neg = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-0.25f), _CMP_LT_OQ);
    __m512i code = _mm512_mask_or_epi32(mag, neg, mag, _mm512_set1_epi32(8));
    __m512i pair = _mm512_or_si512(code, _mm512_srli_epi64(code, 28));
    __m128i bytes = _mm512_cvtepi64_epi8(pair);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
    return;
  }
#endif
  for (int i = 0; i < 8; ++i) {
    uint32_t lo = nv_e2m1_code(xb[2 * i], e, signed_zero);
    uint32_t hi = nv_e2m1_code(xb[2 * i + 1], e, signed_zero);
    out[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

void quantize_rows(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                   float* stored_out, const float* enc, const float* dec, const NvParams& p,
                   int64_t r0, int64_t r1, int* flags) {
  const int64_t k = p.k, nb = k / 16;
  std::vector<float> buf(static_cast<size_t>(k)), vmax(static_cast<size_t>(nb));
  const bool simd = NV_HAVE_AVX512 && !g_force_scalar.load(std::memory_order_relaxed);
  int local = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t e = r / p.rows, rr = r % p.rows;
    float rowmax = load_row(x, r * k, k, p.in_dtype, p, buf.data(), vmax.data(), &local);
    if (local & NV_FLAG_NONFINITE) break;
    NvOuter o;
    if (p.outer_mode == NV_OUTER_ROW) {
      float a = rowmax;
      if (p.has_amax_floor) a = nv_max(a, p.amax_floor);
      o = nv_outer_from_amax(a, p.op_order);
      amax_out[r] = a;
      stored_out[r] = nv_stored(a, o, p.store_conv);
    } else {
      int64_t i = p.outer_stride ? e : 0;
      o.enc = enc[i];
      o.dec = dec[i];
    }
    const float te_mult = nv_te_block_mult(o.enc);
    uint8_t* crow = codes + r * (k / 2);
    for (int64_t b = 0; b < nb; ++b) {
      int undefined = 0;
      uint8_t sb = nv_block_scale(vmax[b], o, te_mult, p, &undefined);
      if (undefined) local |= NV_FLAG_UNDEFINED_SCALE;
      if (p.swizzled) scales[nv_swizzle_offset(e, rr, b, p.rows, nb)] = sb;
      else scales[r * nb + b] = sb;
      NvEnc enc_b = nv_element_encoder(nv_e4m3_value(sb), o, p);
      encode_block(buf.data() + b * 16, enc_b, p.signed_zero, crow + b * 8, simd);
    }
  }
  *flags |= local;
}

template <typename F>
void parallel_rows(int64_t total, int nthreads, F fn) {
  int64_t per_thread_min = 64;
  int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, total / per_thread_min)));
  if (t <= 1) { fn(0, total, 0); return; }
  std::vector<std::thread> pool;
  int64_t chunk = (total + t - 1) / t;
  for (int i = 0; i < t; ++i) {
    int64_t a = i * chunk, b = std::min(total, a + chunk);
    if (a >= b) break;
    pool.emplace_back(fn, a, b, i);
  }
  for (auto& th : pool) th.join();
}

}  // namespace

extern "C" {

void nvfp4_cpu_force_scalar(int on) { g_force_scalar.store(on ? 1 : 0); }

int nvfp4_cpu_has_simd(void) { return NV_HAVE_AVX512; }

int nvfp4_quantize_cpu(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                       float* stored_out, const float* enc, const float* dec,
                       const NvParams* p, int nthreads) {
  if (p->k % 16 != 0) return -1;
  const int64_t total = p->experts * p->rows;
  std::vector<int> flags(static_cast<size_t>(std::max(1, nthreads)), 0);
  parallel_rows(total, nthreads, [&](int64_t a, int64_t b, int i) {
    quantize_rows(x, codes, scales, amax_out, stored_out, enc, dec, *p, a, b, &flags[i]);
  });
  int out = 0;
  for (int f : flags) out |= f;
  return out;
}

int nvfp4_amax_cpu(const void* x, float* amax_out, const NvParams* p, int nthreads) {
  if (p->k % 16 != 0) return -1;
  const int64_t total = p->experts * p->rows, k = p->k, nb = k / 16;
  const int nt = std::max(1, nthreads);
  std::vector<float> part(static_cast<size_t>(nt * p->experts), 0.0f);
  std::vector<int> flags(static_cast<size_t>(nt), 0);
  parallel_rows(total, nt, [&](int64_t a, int64_t b, int i) {
    std::vector<float> buf(static_cast<size_t>(k)), vmax(static_cast<size_t>(nb));
    for (int64_t r = a; r < b; ++r) {
      float m = load_row(x, r * k, k, p->in_dtype, *p, buf.data(), vmax.data(), &flags[i]);
      float& slot = part[static_cast<size_t>(i * p->experts + r / p->rows)];
      slot = std::max(slot, m);
    }
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
