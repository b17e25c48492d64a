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

// E2M1 magnitude code by index 2*floor(4a) + (4a is an integer), a = |z| in [0, 6]
// (the midpoints 0.25, 1.25, 2.5, 5 round down on a tie, 0.75, 1.75, 3.5 up).
alignas(64) const uint8_t kMagByIndex[64] = {
    0, 0, 1, 0, 1, 1, 2, 2, 2, 2, 3, 2, 3, 3, 4, 4, 4, 4, 4, 4, 5, 4, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6,
    6, 6, 6, 6, 6, 6, 6, 6, 7, 6, 7, 7, 7, 7, 7, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

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
      if (dtype != NV_IN_FP32) {
        // 16-bit input: the block maximum on the raw magnitudes (they order like the
        // values; NaN/Inf are the largest), one PHMINPOSUW on their complements.
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            static_cast<const uint16_t*>(x) + base + b * 16));
        v = dtype == NV_IN_BF16
                ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                : _mm512_cvtph_ps(h);
        _mm512_storeu_ps(dst, v);
        __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF));
        __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(mag), _mm256_extracti128_si256(mag, 1));
        __m128i inv = _mm_minpos_epu16(_mm_xor_si128(m8, _mm_set1_epi16(-1)));
        const uint16_t top = static_cast<uint16_t>(~_mm_cvtsi128_si32(inv));
        if (top < (dtype == NV_IN_BF16 ? 0x7F80u : 0x7C00u)) {
          const float mf = load_scalar(&top, 0, dtype);
          vmax[b] = mf;
          rowmax = std::max(rowmax, mf);
          continue;
        }
        bad = true;  // a NaN/Inf block: fixed up below from the widened values in dst
      } else {
        v = _mm512_loadu_ps(static_cast<const float*>(x) + base + b * 16);
        __m512i expo = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7F800000));
        bad = _mm512_cmpeq_epi32_mask(expo, _mm512_set1_epi32(0x7F800000)) != 0;
        _mm512_storeu_ps(dst, v);
        if (!bad) {
          float m = _mm512_reduce_max_ps(_mm512_abs_ps(v));
          vmax[b] = m;
          rowmax = std::max(rowmax, m);
          continue;
        }
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
    // operand order: MAXPS/MINPS return the second operand on NaN, so NaN propagates
#if defined(__AVX512VBMI__)
    // Magnitude code by table: k = 4|z| is exact, and E2M1's midpoints are integers in k,
    // so floor(k) and whether k is an integer pick the code (index 2*floor(k) + exact).
    // NaN (only from an underflowing ModelOpt divisor) gives index 0, code 0, like the spec.
    const __m512 a = _mm512_min_ps(_mm512_set1_ps(6.0f), _mm512_abs_ps(z));
    const __m512 k = _mm512_mul_ps(a, _mm512_set1_ps(4.0f));
    const __m512 fl = _mm512_roundscale_ps(k, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512i idx = _mm512_slli_epi32(_mm512_cvttps_epi32(fl), 1);
    idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(k, fl, _CMP_EQ_OQ), idx, _mm512_set1_epi32(1));
    __m512i mag = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(kMagByIndex));
#else
    z = _mm512_min_ps(_mm512_set1_ps(6.0f), _mm512_max_ps(_mm512_set1_ps(-6.0f), z));
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
#endif
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

#if NV_HAVE_AVX512
// Scales of 16 blocks at once: the same operations as nv_block_scale and
// nv_element_encoder, lane by lane. Writes scale bytes and each block's encoder.
void scale_blocks_simd(const float* vmax, int64_t nb, NvOuter o, float te_mult,
                       const NvParams& p, uint8_t* sbytes, float* mult, float* div,
                       int* undefined) {
  const __m512 flt_max = _mm512_set1_ps(NV_FLT_MAX), zero = _mm512_setzero_ps();
  const __m512 dec = _mm512_set1_ps(o.dec), enc = _mm512_set1_ps(o.enc);
  const __m512 six_dec = _mm512_set1_ps(nv_mul(NV_E2M1_MAX, o.dec));
  const __m512 zmult = _mm512_set1_ps(p.zero_saturate ? NV_FLT_MAX : 0.0f);
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 live = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(live, vmax + b);
    __m512 pre;
    if (p.op_order == NV_ORDER_TE)
      pre = _mm512_min_ps(_mm512_mul_ps(v, _mm512_set1_ps(te_mult)), flt_max);
    else if (p.op_order == NV_ORDER_TORCHAO)
      pre = _mm512_div_ps(_mm512_div_ps(v, _mm512_set1_ps(NV_E2M1_MAX)), dec);
    else
      pre = _mm512_div_ps(v, six_dec);
    if (_mm512_mask_cmp_ps_mask(live, pre, pre, _CMP_UNORD_Q)) *undefined = 1;
    if (p.has_zero_prescale)
      pre = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(pre, zero, _CMP_EQ_OQ), pre,
                                 _mm512_set1_ps(p.zero_prescale_to));
    pre = _mm512_min_ps(_mm512_max_ps(pre, _mm512_set1_ps(p.block_scale_floor)),
                        _mm512_set1_ps(NV_E4M3_MAX));
    // E4M3 RNE: normal values by rounding the fp32 bits to 3 mantissa bits, subnormals
    // by an exact scaling to units of 2^-9 and a round-to-nearest-even conversion.
    __m512i bits = _mm512_castps_si512(pre);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    __m512i rn = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFFF)), odd), 20);
    rn = _mm512_sub_epi32(rn, _mm512_set1_epi32(120 << 3));
    __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(pre, _mm512_set1_ps(512.0f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __mmask16 normal = _mm512_cmp_ps_mask(pre, _mm512_set1_ps(NV_E4M3_MIN_NORMAL), _CMP_GE_OQ);
    __m512i byte = _mm512_mask_blend_epi32(normal, sub, rn);
    _mm_mask_storeu_epi8(sbytes + b, live, _mm512_cvtepi32_epi8(byte));
    // decode the byte back to its exact value
    __m512i e = _mm512_and_si512(_mm512_srli_epi32(byte, 3), _mm512_set1_epi32(15));
    __m512i m = _mm512_and_si512(byte, _mm512_set1_epi32(7));
    __m512 sn = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(m, 20)));
    __m512 ss = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(1.0f / 512.0f));
    __m512 s = _mm512_mask_blend_ps(_mm512_cmpneq_epi32_mask(e, _mm512_setzero_si512()), ss, sn);
    __mmask16 szero = _mm512_cmp_ps_mask(s, zero, _CMP_EQ_OQ);
    __m512 mu = zmult, dv = zero;
    if (p.op_order == NV_ORDER_TE)
      mu = _mm512_min_ps(_mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(s, dec)), flt_max);
    else if (p.op_order == NV_ORDER_TORCHAO)
      mu = _mm512_div_ps(enc, s);
    else
      dv = _mm512_mask_blend_ps(szero, _mm512_mul_ps(s, dec), zero);
    mu = _mm512_mask_blend_ps(szero, mu, zmult);
    _mm512_mask_storeu_ps(mult + b, live, mu);
    _mm512_mask_storeu_ps(div + b, live, dv);
  }
}
#endif

void quantize_rows(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                   float* stored_out, const float* enc, const float* dec, const NvParams& p,
                   int64_t r0, int64_t r1, int* flags) {
  const int64_t k = p.k, nb = k / 16;
  std::vector<float> buf(static_cast<size_t>(k)), vmax(static_cast<size_t>(nb));
  std::vector<float> mults(static_cast<size_t>(nb)), divs(static_cast<size_t>(nb));
  std::vector<uint8_t> sbytes(static_cast<size_t>(nb));
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
#if NV_HAVE_AVX512
    if (simd) {
      int undefined = 0;
      scale_blocks_simd(vmax.data(), nb, o, te_mult, p, sbytes.data(), mults.data(),
                        divs.data(), &undefined);
      if (undefined) local |= NV_FLAG_UNDEFINED_SCALE;
      if (p.swizzled) {
        uint8_t* base = scales + nv_swizzle_row_base(e, rr, p.rows, nb);
        for (int64_t b = 0; b < nb; ++b) base[nv_swizzle_col(b)] = sbytes[b];
      } else {
        memcpy(scales + r * nb, sbytes.data(), static_cast<size_t>(nb));
      }
      for (int64_t b = 0; b < nb; ++b) {
        NvEnc enc_b;
        enc_b.use_div = p.op_order == NV_ORDER_MODELOPT && sbytes[b] != 0;
        enc_b.div = divs[b];
        enc_b.mult = mults[b];
        encode_block(buf.data() + b * 16, enc_b, p.signed_zero, crow + b * 8, true);
      }
      continue;
    }
#endif
    for (int64_t b = 0; b < nb; ++b) {
      int undefined = 0;
      uint8_t sb = nv_block_scale(vmax[b], o, te_mult, p, &undefined);
      if (undefined) local |= NV_FLAG_UNDEFINED_SCALE;
      if (p.swizzled) scales[nv_swizzle_offset(e, rr, b, p.rows, nb)] = sb;
      else scales[r * nb + b] = sb;
      NvEnc enc_b = nv_element_encoder(nv_e4m3_value(sb), o, p);
      encode_block(buf.data() + b * 16, enc_b, p.signed_zero, crow + b * 8, false);
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
  const bool simd = NV_HAVE_AVX512 && !g_force_scalar.load(std::memory_order_relaxed);
  parallel_rows(total, nt, [&](int64_t a, int64_t b, int i) {
    std::vector<float> buf(static_cast<size_t>(k)), vmax(static_cast<size_t>(nb));
    for (int64_t r = a; r < b; ++r) {
      float m = -1.0f;
#if NV_HAVE_AVX512
      // |x| orders like its bit pattern with the sign cleared, so the maximum is an
      // unsigned integer maximum over the raw words; NaN/Inf show up as the largest.
      if (simd && p->in_dtype != NV_IN_FP32) {
        const uint16_t* row = static_cast<const uint16_t*>(x) + r * k;
        const __m512i mask = _mm512_set1_epi16(0x7FFF);
        __m512i acc = _mm512_setzero_si512();
        int64_t j = 0;
        for (; j + 32 <= k; j += 32)
          acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512(row + j), mask));
        __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
        __m128i q = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        alignas(16) uint16_t lanes[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(lanes), q);
        uint32_t top = 0;
        for (int l = 0; l < 8; ++l) top = std::max<uint32_t>(top, lanes[l]);
        for (; j < k; ++j) top = std::max<uint32_t>(top, row[j] & 0x7FFFu);
        const uint32_t inf = p->in_dtype == NV_IN_BF16 ? 0x7F80u : 0x7C00u;
        const uint16_t top16 = static_cast<uint16_t>(top);
        if (top < inf) m = load_scalar(&top16, 0, p->in_dtype);
      }
#endif
      if (m < 0.0f) m = load_row(x, r * k, k, p->in_dtype, *p, buf.data(), vmax.data(), &flags[i]);
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
