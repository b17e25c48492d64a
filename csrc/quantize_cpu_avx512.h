// AVX-512 steps of the CPU kernel (AVX512F/BW/VL/DQ): one block of 16 values is one register.
//
// Not a standalone header: quantize_cpu.cpp includes it inside namespace nv_avx512 and a
// `#pragma GCC target("...,avx512f,avx512bw,avx512vl,avx512dq")` region, then stamps the
// row driver (quantize_cpu_rows.h) with these steps. (VBMI's byte permute, which looks the
// E2M1 codes up in a 64-entry table, was measured no faster per row than the rounding
// below: the row is bound by memory and the load/scale steps, so it is not used.) Each
// step performs the operations of its scalar counterpart (nvfp4_math.h) lane by lane, in
// the same order, so the bits agree; a 4-over-6 block's two error sums stay scalar, in the
// spec's element order.

// Widen one row to fp32 in buf, fill block maxima, return the row maximum; flags on NaN/Inf.
inline float load_row(const void* x, int64_t base, int64_t k, int dtype, const NvParams& p,
                      float* buf, float* vmax, int* flags) {
  const int64_t nb = k / 16;
  float rowmax = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    float* dst = buf + b * 16;
    if (dtype != NV_IN_FP32) {
      // 16-bit input: the block maximum on the raw magnitudes (they order like the
      // values; NaN/Inf are the largest), one PHMINPOSUW on their complements.
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          static_cast<const uint16_t*>(x) + base + b * 16));
      const __m512 v = dtype == NV_IN_BF16
                           ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                           : _mm512_cvtph_ps(h);
      _mm512_storeu_ps(dst, v);
      const __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF));
      const __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(mag), _mm256_extracti128_si256(mag, 1));
      const __m128i inv = _mm_minpos_epu16(_mm_xor_si128(m8, _mm_set1_epi16(-1)));
      const uint16_t top = static_cast<uint16_t>(~_mm_cvtsi128_si32(inv));
      if (top < (dtype == NV_IN_BF16 ? 0x7F80u : 0x7C00u)) {
        const float mf = load_scalar(&top, 0, dtype);
        vmax[b] = mf;
        rowmax = std::max(rowmax, mf);
        continue;
      }
    } else {
      const __m512 v = _mm512_loadu_ps(static_cast<const float*>(x) + base + b * 16);
      const __m512i expo = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7F800000));
      _mm512_storeu_ps(dst, v);
      if (_mm512_cmpeq_epi32_mask(expo, _mm512_set1_epi32(0x7F800000)) == 0) {
        const float m = _mm512_reduce_max_ps(_mm512_abs_ps(v));
        vmax[b] = m;
        rowmax = std::max(rowmax, m);
        continue;
      }
    }
    rowmax = std::max(rowmax, nonfinite_block(dst, p, flags, vmax + b));  // NaN/Inf here
  }
  return rowmax;
}

// The 16 E2M1 codes (sign bit 3) of scaled values z under the signed-zero policy.
// Magnitude code by rounding, as in the AVX2 path (quantize_cpu_avx2.h, mags8): on
// [0, 2) rint(2|z|), on [2, 4) rint(|z|) + 2, on [4, 6] rint(|z|/2) + 4, |z| clamped to
// 6; exact scalings and round-half-even conversion put the ties where the spec's
// midpoints do. A NaN z (MINPS keeps it) converts to 0x80000000, masked to code 0.
inline __m512i codes16(__m512 z, int signed_zero) {
  const __m512 a = _mm512_min_ps(_mm512_set1_ps(NV_E2M1_MAX), _mm512_abs_ps(z));
  const __mmask16 ge2 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_GE_OQ);
  const __mmask16 ge4 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_GE_OQ);
  const __m512 s = _mm512_mask_blend_ps(ge4, _mm512_mask_blend_ps(ge2, _mm512_set1_ps(2.0f), _mm512_set1_ps(1.0f)),
                                        _mm512_set1_ps(0.5f));
  const __m512i two = _mm512_set1_epi32(2);
  __m512i mag = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  mag = _mm512_mask_add_epi32(mag, ge2, mag, two);
  mag = _mm512_and_si512(_mm512_mask_add_epi32(mag, ge4, mag, two), _mm512_set1_epi32(7));
  __mmask16 neg;
  if (signed_zero == NV_SZ_SIGN_OF_INPUT)
    neg = _mm512_movepi32_mask(_mm512_castps_si512(z));
  else if (signed_zero == NV_SZ_SIGN_OF_NONZERO)
    neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  else
    neg = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-0.25f), _CMP_LT_OQ);
  return _mm512_mask_or_epi32(mag, neg, mag, _mm512_set1_epi32(8));
}

// 16 codes (one per dword) -> 8 packed bytes, the even element in the low nibble.
inline void store_codes(__m512i code, uint8_t* out) {
  const __m512i pair = _mm512_or_si512(code, _mm512_srli_epi64(code, 28));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(pair));
}

// Encode one block of 16 fp32 values into 8 packed bytes.
inline void encode_block(const float* xb, NvEnc e, int signed_zero, uint8_t* out) {
  const __m512 x = _mm512_loadu_ps(xb);
  const __m512 z = e.use_div ? _mm512_div_ps(x, _mm512_set1_ps(e.div))
                             : _mm512_mul_ps(x, _mm512_set1_ps(e.mult));
  store_codes(codes16(z, signed_zero), out);
}

// One 4-over-6 candidate of the block x (the steps of nv_fos_candidate, nvfp4_math.h): the
// scale byte and multiplier in scalar, the 16 codes and reconstruction errors in one
// register each, then the errors summed in scalar in the spec's element order (TE: one
// after another; FlashInfer: two halves of 8, then added).
inline uint8_t fos_candidate(__m512 x, float pre, float dec, float amax, float six_e,
                             const NvParams& p, __m512i* codes, float* err) {
  const uint8_t sb = nv_e4m3_bits(nv_min(pre, NV_E4M3_MAX));
  const float s = nv_e4m3_value(sb);
  const float m = nv_min(nv_div(1.0f, nv_mul(s, dec)), NV_FLT_MAX);
  const __m512i c = codes16(_mm512_mul_ps(x, _mm512_set1_ps(m)), p.signed_zero);
  const __m512 grid = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                     0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m512 q = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(_mm512_permutexvar_ps(c, grid)),  // index bits 0-3: 8 -> 0
      _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(8)), 28)));
  const __m512 val = _mm512_div_ps(_mm512_mul_ps(_mm512_mul_ps(q, _mm512_set1_ps(s)),
                                                 _mm512_set1_ps(amax)), _mm512_set1_ps(six_e));
  const __m512 d = _mm512_sub_ps(val, x);
  const __m512 t = p.four_over_six_error == NV_FOS_MSE ? _mm512_mul_ps(d, d) : _mm512_abs_ps(d);
  alignas(64) float ts[16];
  _mm512_store_ps(ts, t);
  *err = nv_fos_error_sum(ts, p.four_over_six);
  *codes = c;
  return sb;
}

// A 4-over-6 block (nv_fos_block's steps): the kept candidate's byte, its codes in out.
inline uint8_t fos_block(const float* xb, float v, NvOuter o, float amax, const NvParams& p,
                         uint8_t* out) {
  const __m512 x = _mm512_loadu_ps(xb);
  const float six_e = nv_mul(NV_E2M1_MAX, p.e4m3_max);
  const float base = nv_mul(nv_div(v, NV_E2M1_MAX), o.enc);
  __m512i c6, c4;
  float e6, e4;
  const uint8_t b6 = fos_candidate(x, base, o.dec, amax, six_e, p, &c6, &e6);
  const uint8_t b4 = fos_candidate(x, nv_mul(base, 1.5f), o.dec, amax, six_e, p, &c4, &e4);
  const bool pick4 = e4 < e6;
  if (p.four_over_six == NV_FOS_FLASHINFER && v == 0.0f) memset(out, 0, 8);
  else store_codes(pick4 ? c4 : c6, out);
  return pick4 ? b4 : b6;
}

// Scales of 16 blocks at once: the same operations as nv_block_scale and
// nv_element_encoder, lane by lane. Writes scale bytes and each block's encoder.
inline void scale_blocks(const float* vmax, int64_t nb, NvOuter o, float te_mult,
                         const NvParams& p, uint8_t* sbytes, float* mult, float* div,
                         int* undefined) {
  const __m512 flt_max = _mm512_set1_ps(NV_FLT_MAX), zero = _mm512_setzero_ps();
  const __m512 dec = _mm512_set1_ps(o.dec), enc = _mm512_set1_ps(o.enc);
  const __m512 six_dec = _mm512_set1_ps(nv_mul(NV_E2M1_MAX, o.dec));
  const __m512 zmult = _mm512_set1_ps(p.zero_saturate ? NV_FLT_MAX : 0.0f);
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 live = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(live, vmax + b);
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
    const __m512i bits = _mm512_castps_si512(pre);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    __m512i rn = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFFF)), odd), 20);
    rn = _mm512_sub_epi32(rn, _mm512_set1_epi32(120 << 3));
    const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(pre, _mm512_set1_ps(512.0f)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 normal = _mm512_cmp_ps_mask(pre, _mm512_set1_ps(NV_E4M3_MIN_NORMAL), _CMP_GE_OQ);
    const __m512i byte = _mm512_mask_blend_epi32(normal, sub, rn);
    _mm_mask_storeu_epi8(sbytes + b, live, _mm512_cvtepi32_epi8(byte));
    // decode the byte back to its exact value
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(byte, 3), _mm512_set1_epi32(15));
    const __m512i m = _mm512_and_si512(byte, _mm512_set1_epi32(7));
    const __m512 sn = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(m, 20)));
    const __m512 ss = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(1.0f / 512.0f));
    const __m512 s = _mm512_mask_blend_ps(_mm512_cmpneq_epi32_mask(e, _mm512_setzero_si512()), ss, sn);
    const __mmask16 szero = _mm512_cmp_ps_mask(s, zero, _CMP_EQ_OQ);
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

// max |x| of a 16-bit row from the raw words (|x| orders like its bits with the sign
// cleared; NaN/Inf are the largest): -1 when the row holds NaN/Inf.
inline float row_max16(const void* x, int64_t base, int64_t k, int dtype) {
  const uint16_t* row = static_cast<const uint16_t*>(x) + base;
  const __m512i mask = _mm512_set1_epi16(0x7FFF);
  __m512i acc = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 32 <= k; j += 32)
    acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512(row + j), mask));
  const __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  const __m128i q = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  uint32_t top = static_cast<uint16_t>(~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi16(-1)))));
  for (; j < k; ++j) top = std::max<uint32_t>(top, row[j] & 0x7FFFu);
  const uint16_t top16 = static_cast<uint16_t>(top);
  return top < (dtype == NV_IN_BF16 ? 0x7F80u : 0x7C00u) ? load_scalar(&top16, 0, dtype) : -1.0f;
}
