// AVX2 steps of the CPU kernel (AVX2 + F16C, no FMA): a block of 16 values is two registers.
//
// Not a standalone header: quantize_cpu.cpp includes it inside namespace nv_avx2 and a
// `#pragma GCC target("avx2,f16c")` region, then stamps the row driver
// (quantize_cpu_rows.h) with these steps. Each step performs the operations of its
// scalar counterpart (nvfp4_math.h) lane by lane, in the same order (FMA is not enabled
// and the build passes -ffp-contract=off, so nothing is fused), and the bits agree:
//   - bf16 widens exactly by a 16-bit shift, fp16 exactly by VCVTPH2PS;
//   - MINPS/MAXPS return their second operand when either is NaN, as the scalar
//     `a < b ? a : b` does, so the operand order below is the scalar code's;
//   - VCVTPS2DQ rounds half to even under the default MXCSR mode, as rintf does.

// The 16 magnitudes of one block as u16 -> their maximum's bits (NaN/Inf are the largest).
inline uint16_t block_top16(__m256i h) {
  const __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF));
  const __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(mag), _mm256_extracti128_si256(mag, 1));
  const __m128i inv = _mm_minpos_epu16(_mm_xor_si128(m8, _mm_set1_epi16(-1)));
  return static_cast<uint16_t>(~_mm_cvtsi128_si32(inv));
}

inline float hmax8(__m256 v) {  // v holds no NaN
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// Widen one row to fp32 in buf, fill block maxima, return the row maximum; flags on NaN/Inf.
inline float load_row(const void* x, int64_t base, int64_t k, int dtype, const NvParams& p,
                      float* buf, float* vmax, int* flags) {
  const int64_t nb = k / 16;
  const uint32_t inf16 = dtype == NV_IN_BF16 ? 0x7F80u : 0x7C00u;
  float rowmax = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    float* dst = buf + b * 16;
    if (dtype != NV_IN_FP32) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          static_cast<const uint16_t*>(x) + base + b * 16));
      const __m128i h0 = _mm256_castsi256_si128(h), h1 = _mm256_extracti128_si256(h, 1);
      if (dtype == NV_IN_BF16) {
        _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16)));
        _mm256_storeu_ps(dst + 8, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16)));
      } else {
        _mm256_storeu_ps(dst, _mm256_cvtph_ps(h0));
        _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(h1));
      }
      const uint16_t top = block_top16(h);
      if (top < inf16) {
        const float mf = load_scalar(&top, 0, dtype);
        vmax[b] = mf;
        rowmax = std::max(rowmax, mf);
        continue;
      }
    } else {
      const float* src = static_cast<const float*>(x) + base + b * 16;
      const __m256 v0 = _mm256_loadu_ps(src), v1 = _mm256_loadu_ps(src + 8);
      _mm256_storeu_ps(dst, v0);
      _mm256_storeu_ps(dst + 8, v1);
      const __m256i em = _mm256_set1_epi32(0x7F800000);
      const __m256i bad = _mm256_or_si256(
          _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v0), em), em),
          _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v1), em), em));
      if (_mm256_testz_si256(bad, bad)) {
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        const float m = hmax8(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)));
        vmax[b] = m;
        rowmax = std::max(rowmax, m);
        continue;
      }
    }
    rowmax = std::max(rowmax, nonfinite_block(dst, p, flags, vmax + b));  // NaN/Inf here
  }
  return rowmax;
}

// E2M1 magnitude codes of 8 scaled values as dwords, by rounding instead of comparing:
// on [0, 2) the code is rint(2|z|), on [2, 4) rint(|z|) + 2, on [4, 6] rint(|z|/2) + 4
// (|z| clamped to 6). Scaling by 2, 1 or 1/2 is exact and VCVTPS2DQ rounds half to even,
// which puts the ties where the spec's midpoints put them: 0.25 -> 0, 0.75 -> 2 (code of
// 1), 1.25 -> 2, 1.75 -> 4, 2.5 -> 4, 3.5 -> 6, 5 -> 6. A NaN z stays NaN through MINPS
// (second operand) and converts to 0x80000000, which the unsigned-saturating pack turns
// into code 0, as in the spec.
inline __m256i mags8(__m256 z) {
  const __m256 a = _mm256_min_ps(_mm256_set1_ps(NV_E2M1_MAX),
                                 _mm256_and_ps(z, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))));
  const __m256 ge2 = _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_GE_OQ);
  const __m256 ge4 = _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_GE_OQ);
  const __m256 s = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_set1_ps(2.0f), _mm256_set1_ps(1.0f), ge2),
                                    _mm256_set1_ps(0.5f), ge4);
  const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(a, s));
  const __m256i n = _mm256_add_epi32(_mm256_castps_si256(ge2), _mm256_castps_si256(ge4));  // -0, -1, -2
  return _mm256_sub_epi32(r, _mm256_add_epi32(n, n));
}

// The sign bits (as all-ones dwords) of 8 scaled values under the signed-zero policy:
// negative z ('sign_of_input'), z < 0 ('sign_of_nonzero'), z < -0.25 ('positive').
inline __m256i negs8(__m256 z, int signed_zero) {
  if (signed_zero == NV_SZ_SIGN_OF_INPUT) return _mm256_srai_epi32(_mm256_castps_si256(z), 31);
  const __m256 t = _mm256_set1_ps(signed_zero == NV_SZ_SIGN_OF_NONZERO ? 0.0f : -0.25f);
  return _mm256_castps_si256(_mm256_cmp_ps(z, t, _CMP_LT_OQ));
}

// 16 codes as magnitudes (dwords, elements 0-7 in m0, 8-15 in m1) and sign masks (n0, n1)
// -> 8 packed bytes, the even element in the low nibble.
inline void store_codes(__m256i m0, __m256i m1, __m256i n0, __m256i n1, uint8_t* out) {
  // words, per 128-bit lane: lane 0 = codes 0-3, 8-11; lane 1 = codes 4-7, 12-15
  const __m256i w = _mm256_or_si256(_mm256_packus_epi32(m0, m1),
                                    _mm256_and_si256(_mm256_packs_epi32(n0, n1), _mm256_set1_epi16(8)));
  // each dword's low byte = its even code | its odd code << 4: pairs (0,1) (2,3) (8,9)
  // (10,11) in lane 0, (4,5) (6,7) (12,13) (14,15) in lane 1
  const __m256i y = _mm256_or_si256(w, _mm256_srli_epi32(w, 12));
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i q = _mm256_shuffle_epi8(y, pick);
  // interleave the two lanes' 16-bit pairs of bytes: bytes 0-1, 2-3, 4-5, 6-7 in order
  const __m128i bytes = _mm_unpacklo_epi16(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
}

// Encode one block of 16 fp32 values into 8 packed bytes (low nibble = even element).
inline void encode_block(const float* xb, NvEnc e, int signed_zero, uint8_t* out) {
  const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
  __m256 z0, z1;
  if (e.use_div) {
    const __m256 d = _mm256_set1_ps(e.div);
    z0 = _mm256_div_ps(x0, d);
    z1 = _mm256_div_ps(x1, d);
  } else {
    const __m256 m = _mm256_set1_ps(e.mult);
    z0 = _mm256_mul_ps(x0, m);
    z1 = _mm256_mul_ps(x1, m);
  }
  store_codes(mags8(z0), mags8(z1), negs8(z0, signed_zero), negs8(z1, signed_zero), out);
}

// Scales of 8 blocks at once: the same operations as nv_block_scale and
// nv_element_encoder, lane by lane. Writes scale bytes and each block's encoder. vmax,
// sbytes, mult and div hold at least nb rounded up to 8 entries.
inline void scale_blocks(const float* vmax, int64_t nb, NvOuter o, float te_mult,
                         const NvParams& p, uint8_t* sbytes, float* mult, float* div,
                         int* undefined) {
  const __m256 flt_max = _mm256_set1_ps(NV_FLT_MAX), zero = _mm256_setzero_ps();
  const __m256 dec = _mm256_set1_ps(o.dec), enc = _mm256_set1_ps(o.enc);
  const __m256 six_dec = _mm256_set1_ps(nv_mul(NV_E2M1_MAX, o.dec));
  const __m256 zmult = _mm256_set1_ps(p.zero_saturate ? NV_FLT_MAX : 0.0f);
  const __m256i gather = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t b = 0; b < nb; b += 8) {
    const int live = static_cast<int>(std::min<int64_t>(8, nb - b));
    const int live_bits = (1 << live) - 1;
    __m256 v;
    if (live == 8) {
      v = _mm256_loadu_ps(vmax + b);
    } else {
      alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      memcpy(t, vmax + b, static_cast<size_t>(live) * sizeof(float));
      v = _mm256_load_ps(t);
    }
    __m256 pre;
    if (p.op_order == NV_ORDER_TE)
      pre = _mm256_min_ps(_mm256_mul_ps(v, _mm256_set1_ps(te_mult)), flt_max);
    else if (p.op_order == NV_ORDER_TORCHAO)
      pre = _mm256_div_ps(_mm256_div_ps(v, _mm256_set1_ps(NV_E2M1_MAX)), dec);
    else
      pre = _mm256_div_ps(v, six_dec);
    if (_mm256_movemask_ps(_mm256_cmp_ps(pre, pre, _CMP_UNORD_Q)) & live_bits) *undefined = 1;
    if (p.has_zero_prescale)
      pre = _mm256_blendv_ps(pre, _mm256_set1_ps(p.zero_prescale_to), _mm256_cmp_ps(pre, zero, _CMP_EQ_OQ));
    pre = _mm256_min_ps(_mm256_max_ps(pre, _mm256_set1_ps(p.block_scale_floor)),
                        _mm256_set1_ps(NV_E4M3_MAX));
    // E4M3 RNE: normal values by rounding the fp32 bits to 3 mantissa bits, subnormals
    // by an exact scaling to units of 2^-9 and a round-to-nearest-even conversion.
    const __m256i bits = _mm256_castps_si256(pre);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
    __m256i rn = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFFF)), odd), 20);
    rn = _mm256_sub_epi32(rn, _mm256_set1_epi32(120 << 3));
    const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(pre, _mm256_set1_ps(512.0f)));
    const __m256 normal = _mm256_cmp_ps(pre, _mm256_set1_ps(NV_E4M3_MIN_NORMAL), _CMP_GE_OQ);
    const __m256i byte = _mm256_blendv_epi8(sub, rn, _mm256_castps_si256(normal));
    const __m256i packed = _mm256_shuffle_epi8(byte, gather);
    const __m128i b8 = _mm_unpacklo_epi32(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
    // decode the byte back to its exact value
    const __m256i e = _mm256_and_si256(_mm256_srli_epi32(byte, 3), _mm256_set1_epi32(15));
    const __m256i m = _mm256_and_si256(byte, _mm256_set1_epi32(7));
    const __m256 sn = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23), _mm256_slli_epi32(m, 20)));
    const __m256 ss = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(1.0f / 512.0f));
    const __m256 sub_e = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    const __m256 s = _mm256_blendv_ps(sn, ss, sub_e);
    const __m256 szero = _mm256_cmp_ps(s, zero, _CMP_EQ_OQ);
    __m256 mu = zmult, dv = zero;
    if (p.op_order == NV_ORDER_TE)
      mu = _mm256_min_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(s, dec)), flt_max);
    else if (p.op_order == NV_ORDER_TORCHAO)
      mu = _mm256_div_ps(enc, s);
    else
      dv = _mm256_blendv_ps(_mm256_mul_ps(s, dec), zero, szero);
    mu = _mm256_blendv_ps(mu, zmult, szero);
    if (live == 8) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(sbytes + b), b8);
      _mm256_storeu_ps(mult + b, mu);
      _mm256_storeu_ps(div + b, dv);
    } else {
      alignas(32) float tm[8], td[8];
      alignas(16) uint8_t tb[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(tb), b8);
      _mm256_store_ps(tm, mu);
      _mm256_store_ps(td, dv);
      memcpy(sbytes + b, tb, static_cast<size_t>(live));
      memcpy(mult + b, tm, static_cast<size_t>(live) * sizeof(float));
      memcpy(div + b, td, static_cast<size_t>(live) * sizeof(float));
    }
  }
}

// max |x| of a 16-bit row from the raw words (|x| orders like its bits with the sign
// cleared; NaN/Inf are the largest): -1 when the row holds NaN/Inf.
inline float row_max16(const void* x, int64_t base, int64_t k, int dtype) {
  const uint16_t* row = static_cast<const uint16_t*>(x) + base;
  const __m256i mask = _mm256_set1_epi16(0x7FFF);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    acc0 = _mm256_max_epu16(acc0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j)), mask));
    acc1 = _mm256_max_epu16(acc1, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j + 16)), mask));
  }
  uint32_t top = block_top16(_mm256_max_epu16(acc0, acc1));
  for (; j < k; ++j) top = std::max<uint32_t>(top, row[j] & 0x7FFFu);
  const uint16_t top16 = static_cast<uint16_t>(top);
  return top < (dtype == NV_IN_BF16 ? 0x7F80u : 0x7C00u) ? load_scalar(&top16, 0, dtype) : -1.0f;
}

// The reconstruction errors of 8 values x with codes (magnitudes m, sign masks n) under
// scale s (nv_fos_candidate's steps, lane by lane): |e| (MAE) or fl(e * e) (MSE), with
// e = fl(fl(fl(fl(q * s) * amax) / six_e) - x).
inline __m256 fos_terms8(__m256 x, __m256i m, __m256i n, float s, float amax, float six_e,
                         int mse) {
  const __m256 grid = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 q = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_castps_si256(_mm256_permutevar8x32_ps(grid, m)),
      _mm256_and_si256(n, _mm256_set1_epi32(static_cast<int>(0x80000000u)))));
  const __m256 val = _mm256_div_ps(_mm256_mul_ps(_mm256_mul_ps(q, _mm256_set1_ps(s)),
                                                 _mm256_set1_ps(amax)), _mm256_set1_ps(six_e));
  const __m256 d = _mm256_sub_ps(val, x);
  return mse ? _mm256_mul_ps(d, d)
             : _mm256_and_ps(d, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
}

// One 4-over-6 candidate of the block (x0, x1): scale byte and multiplier in scalar, codes
// and errors 8 lanes at a time, the errors summed in scalar in the spec's element order.
inline uint8_t fos_candidate(__m256 x0, __m256 x1, float pre, float dec, float amax,
                             float six_e, const NvParams& p, __m256i* c, float* err) {
  const uint8_t sb = nv_e4m3_bits(nv_min(pre, NV_E4M3_MAX));
  const float s = nv_e4m3_value(sb);
  const __m256 mult = _mm256_set1_ps(nv_min(nv_div(1.0f, nv_mul(s, dec)), NV_FLT_MAX));
  const __m256 z0 = _mm256_mul_ps(x0, mult), z1 = _mm256_mul_ps(x1, mult);
  c[0] = mags8(z0);
  c[1] = mags8(z1);
  c[2] = negs8(z0, p.signed_zero);
  c[3] = negs8(z1, p.signed_zero);
  const int mse = p.four_over_six_error == NV_FOS_MSE;
  alignas(32) float ts[16];
  _mm256_store_ps(ts, fos_terms8(x0, c[0], c[2], s, amax, six_e, mse));
  _mm256_store_ps(ts + 8, fos_terms8(x1, c[1], c[3], s, amax, six_e, mse));
  *err = nv_fos_error_sum(ts, p.four_over_six);
  return sb;
}

// A 4-over-6 block (nv_fos_block's steps): the kept candidate's byte, its codes in out.
inline uint8_t fos_block(const float* xb, float v, NvOuter o, float amax, const NvParams& p,
                         uint8_t* out) {
  const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
  const float six_e = nv_mul(NV_E2M1_MAX, p.e4m3_max);
  const float base = nv_mul(nv_div(v, NV_E2M1_MAX), o.enc);
  __m256i c6[4], c4[4];
  float e6, e4;
  const uint8_t b6 = fos_candidate(x0, x1, base, o.dec, amax, six_e, p, c6, &e6);
  const uint8_t b4 = fos_candidate(x0, x1, nv_mul(base, 1.5f), o.dec, amax, six_e, p, c4, &e4);
  const bool pick4 = e4 < e6;
  const __m256i* c = pick4 ? c4 : c6;
  if (p.four_over_six == NV_FOS_FLASHINFER && v == 0.0f) memset(out, 0, 8);
  else store_codes(c[0], c[1], c[2], c[3], out);
  return pick4 ? b4 : b6;
}
