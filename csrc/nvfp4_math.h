// NVFP4 scalar numerics shared by the CPU and CUDA kernels.
//
// Each function is the fp32 operation sequence of one step of libalign.spec.quantize
// (see libalign/spec/scale_math.py for the orders): one IEEE rounding per operation, in the
// same association, never fused. On the device the explicit __fdiv_rn/__fmul_rn
// intrinsics keep nvcc from contracting or approximating; on the host the build uses
// -ffp-contract=off and no fast-math.
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>
#include "nvfp4_abi.h"

#if defined(__CUDACC__)
#define NV_HD __host__ __device__ __forceinline__
#else
#define NV_HD static inline
#endif

#define NV_FLT_MAX 3.4028234663852886e38f
#define NV_E4M3_MAX 448.0f
#define NV_E2M1_MAX 6.0f
#define NV_FP8_TIMES_FP4_MAX 2688.0f
#define NV_E4M3_MIN_NORMAL 0.015625f  // 2^-6

NV_HD float nv_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

NV_HD float nv_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

NV_HD uint32_t nv_f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u; memcpy(&u, &f, 4); return u;
#endif
}

NV_HD float nv_u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; memcpy(&f, &u, 4); return f;
#endif
}

NV_HD float nv_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

NV_HD float nv_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// torch.minimum / clamp semantics for the non-NaN values that reach them here.
NV_HD float nv_min(float a, float b) { return a < b ? a : b; }
NV_HD float nv_max(float a, float b) { return a > b ? a : b; }

typedef struct NvOuter { float enc, dec; } NvOuter;

// Outer scales from the floored outer maximum (scale_math.outer_from_amax); e4m3_max is
// the spec's E4M3 bound (te order: 448, or 256 for 4-over-6, so enc = fl(1536 / a)).
NV_HD NvOuter nv_outer_from_amax(float a, int order, float e4m3_max) {
  NvOuter o;
  if (order == NV_ORDER_TE) {
    float enc = nv_min(nv_div(nv_mul(NV_E2M1_MAX, e4m3_max), a), NV_FLT_MAX);
    if (enc == 0.0f) enc = 1.0f;
    o.enc = enc;
    o.dec = nv_div(1.0f, enc);
  } else {  // torchao, modelopt
    o.dec = nv_div(a, NV_FP8_TIMES_FP4_MAX);
    o.enc = nv_div(1.0f, o.dec);
  }
  return o;
}

// The TE order's block-scale multiplier fl(enc * fl(1/6)), hoisted out of the block loop.
NV_HD float nv_te_block_mult(float enc) { return nv_mul(enc, nv_div(1.0f, NV_E2M1_MAX)); }

// fp32 block scale before clamping (scale_math.block_prescale); te_mult from above.
NV_HD float nv_block_prescale(float v, NvOuter o, float te_mult, int order) {
  if (order == NV_ORDER_TE) return nv_min(nv_mul(v, te_mult), NV_FLT_MAX);
  if (order == NV_ORDER_TORCHAO) return nv_div(nv_div(v, NV_E2M1_MAX), o.dec);
  return nv_div(v, nv_mul(NV_E2M1_MAX, o.dec));  // modelopt
}

// Clamped fp32 value in [0, 448] -> E4M3 byte, round half to even (rounding.round_e4m3_bits).
NV_HD uint8_t nv_e4m3_bits(float v) {
  if (v >= NV_E4M3_MIN_NORMAL) {
    uint32_t b = nv_f2u(v);
    uint32_t r = (b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;  // RNE to 3 mantissa bits
    return (uint8_t)(r - (120u << 3));                     // rebias 127 -> 7
  }
  return (uint8_t)rintf(v * 512.0f);  // subnormal quantum 2^-9; exact scaling, RNE
}

// E4M3 byte (non-negative) -> its exact fp32 value.
NV_HD float nv_e4m3_value(uint8_t byte) {
  uint32_t e = (byte >> 3) & 0xFu, m = byte & 7u;
  if (e == 0) return (float)m * (1.0f / 512.0f);
  return nv_u2f(((e + 120u) << 23) | (m << 20));
}

// Block scale byte from block maximum v: prescale, zero substitution, clamp, E4M3 RNE.
// Sets *undefined when the preset's arithmetic gives NaN (0/0 on an all-zero domain).
NV_HD uint8_t nv_block_scale(float v, NvOuter o, float te_mult, const NvParams& p,
                             int* undefined) {
  float pre = nv_block_prescale(v, o, te_mult, p.op_order);
  if (pre != pre) { *undefined = 1; return 0; }
  if (p.has_zero_prescale && pre == 0.0f) pre = p.zero_prescale_to;
  float lo = p.block_scale_floor;
  pre = nv_min(nv_max(pre, lo), NV_E4M3_MAX);
  return nv_e4m3_bits(pre);
}

// How a block's elements are scaled: z = x * mult, or z = x / div (ModelOpt).
typedef struct NvEnc { float mult; float div; int use_div; } NvEnc;

NV_HD NvEnc nv_element_encoder(float s, NvOuter o, const NvParams& p) {
  NvEnc e; e.mult = 0.0f; e.div = 1.0f; e.use_div = 0;
  if (s == 0.0f) { e.mult = p.zero_saturate ? NV_FLT_MAX : 0.0f; return e; }
  if (p.op_order == NV_ORDER_TE) {
    e.mult = nv_min(nv_div(1.0f, nv_mul(s, o.dec)), NV_FLT_MAX);
  } else if (p.op_order == NV_ORDER_TORCHAO) {
    e.mult = nv_div(o.enc, s);
  } else {
    e.use_div = 1; e.div = nv_mul(s, o.dec);
  }
  return e;
}

// One element -> its E2M1 code under the signed-zero policy (rounding.round_e2m1).
NV_HD uint32_t nv_e2m1_code(float x, NvEnc e, int signed_zero) {
  float z = e.use_div ? nv_div(x, e.div) : nv_mul(x, e.mult);
  z = z > NV_E2M1_MAX ? NV_E2M1_MAX : (z < -NV_E2M1_MAX ? -NV_E2M1_MAX : z);  // NaN stays NaN
  float a = fabsf(z);
  uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                 (a >= 3.5f) + (a > 5.0f);
  uint32_t neg;
  if (signed_zero == NV_SZ_SIGN_OF_INPUT) neg = nv_f2u(z) >> 31;
  else if (signed_zero == NV_SZ_SIGN_OF_NONZERO) neg = z < 0.0f;
  else neg = z < -0.25f;
  return mag | (neg << 3);
}

// The magnitude code 0..7 of nv_e2m1_code from a scaled value z, in fewer operations (the
// GPU's inner loop). |z| is clamped to 6; below 1 the E2M1 step is 0.5, so the code is
// rint(2|z|), formed by adding 2^23 (whose ulp is 1) in one correctly rounded FMA; from 1
// up the format is a float with one mantissa bit, so rounding the fp32 bits to one
// mantissa bit (half to even) and rebiasing the exponent gives the code. The sign bit is
// the caller's: z is negative and |z| passes the policy's threshold nv_neg_threshold
// (0.25 for 'positive', 0 for 'sign_of_nonzero', -1 for 'sign_of_input'). z must not be
// NaN.
NV_HD uint32_t nv_e2m1_mag(float z) {
  const float a = fminf(fabsf(z), NV_E2M1_MAX);
  const uint32_t b = nv_f2u(a);
  const uint32_t lo = nv_f2u(fmaf(a, 2.0f, 8388608.0f)) & 3u;
  const uint32_t hi = (b + 0x1FFFFFu + ((b >> 22) & 1u) - (252u << 22)) >> 22;
  return a < 1.0f ? lo : hi;
}

NV_HD float nv_neg_threshold(int signed_zero) {
  return signed_zero == NV_SZ_POSITIVE ? 0.25f : (signed_zero == NV_SZ_SIGN_OF_NONZERO ? 0.0f : -1.0f);
}

// Stored outer value of a row in ROW mode (scale_math.stored_from_outer); FlashInfer's
// 4-over-6 stores a decode scale 0 for an all-zero row (four_over_six.stored_outer).
NV_HD float nv_stored(float amax, NvOuter o, const NvParams& p) {
  if (p.four_over_six == NV_FOS_FLASHINFER && p.store_conv == NV_STORE_DEC && amax == 0.0f)
    return 0.0f;
  return p.store_conv == NV_STORE_AMAX ? amax : (p.store_conv == NV_STORE_ENC ? o.enc : o.dec);
}

// --- 4-over-6 block scaling (libalign/spec/four_over_six.py) ------------------------------

// E2M1 code 0x0..0xF -> its fp32 value (0x8 -> -0.0), exactly.
NV_HD float nv_e2m1_value(uint32_t code) {
  const uint32_t m = code & 7u;
  const float mag = m < 4u ? 0.5f * static_cast<float>(m) : static_cast<float>(m == 7u ? 6u : m - 2u);
  return nv_u2f(nv_f2u(mag) | ((code & 8u) << 28));
}

// The summed error of a 4-over-6 candidate from its 16 fp32 terms t (|e_i| or e_i^2), in the
// rule's order: from 0 in element order (TE), or each half of 8 from 0, then the halves added
// (FlashInfer). Every path (scalar, SIMD, CUDA) sums through here.
NV_HD float nv_fos_error_sum(const float* t, int rule) {
  float lo = 0.0f, hi = 0.0f;
  for (int i = 0; i < 16; ++i) {
    if (rule == NV_FOS_TE || i < 8) lo = nv_add(lo, t[i]);
    else hi = nv_add(hi, t[i]);
  }
  return rule == NV_FOS_TE ? lo : nv_add(lo, hi);
}

// One candidate of a 4-over-6 block from its block scale before the cast, pre: the E4M3
// byte, the 16 codes packed (element i at bits 4i) and the summed error, each step one
// fp32 rounding in the spec's order:
//   s = E4M3_RNE(min(pre, 448)), m = min(fl(1 / fl(s * D)), FLT_MAX),
//   q_i = E2M1_RNE(clamp(fl(x_i * m), -6, 6)),
//   e_i = fl(fl(fl(fl(q_i * s) * A) / fl(6E)) - x_i), |e_i| (MAE) or fl(e_i * e_i) (MSE),
//   summed from 0 in element order (TE) or as two halves of 8 then added (FlashInfer).
NV_HD uint8_t nv_fos_candidate(const float* x, float pre, float dec, float amax, float six_e,
                               const NvParams& p, uint64_t* codes, float* err) {
  const uint8_t sb = nv_e4m3_bits(nv_min(pre, NV_E4M3_MAX));
  const float s = nv_e4m3_value(sb);
  NvEnc e;
  e.mult = nv_min(nv_div(1.0f, nv_mul(s, dec)), NV_FLT_MAX);
  e.div = 1.0f;
  e.use_div = 0;
  const int mse = p.four_over_six_error == NV_FOS_MSE;
  float t[16];
  uint64_t packed = 0;
  for (int i = 0; i < 16; ++i) {
    const uint32_t code = nv_e2m1_code(x[i], e, p.signed_zero);
    packed |= static_cast<uint64_t>(code) << (4 * i);
    const float val = nv_div(nv_mul(nv_mul(nv_e2m1_value(code), s), amax), six_e);
    const float d = nv_sub(val, x[i]);
    t[i] = mse ? nv_mul(d, d) : fabsf(d);
  }
  *codes = packed;
  *err = nv_fos_error_sum(t, p.four_over_six);
  return sb;
}

// A 4-over-6 block of 16 fp32 values x with block maximum v, the row's outer scales o (te
// order) and outer maximum amax: the kept candidate's E4M3 byte, its codes in *codes (8
// packed bytes, element 2j in the low nibble of byte j). Map-to-6 has the block scale
// base = fl(fl(v / 6) * enc), map-to-4 fl(base * 1.5); map-to-4 is kept only when its error
// is strictly smaller. FlashInfer stores codes 0 for a block whose maximum is 0.
NV_HD uint8_t nv_fos_block(const float* x, float v, NvOuter o, float amax, const NvParams& p,
                           uint64_t* codes) {
  const float six_e = nv_mul(NV_E2M1_MAX, p.e4m3_max);
  const float base = nv_mul(nv_div(v, NV_E2M1_MAX), o.enc);
  uint64_t c6, c4;
  float e6, e4;
  const uint8_t b6 = nv_fos_candidate(x, base, o.dec, amax, six_e, p, &c6, &e6);
  const uint8_t b4 = nv_fos_candidate(x, nv_mul(base, 1.5f), o.dec, amax, six_e, p, &c4, &e4);
  const bool pick4 = e4 < e6;
  *codes = (p.four_over_six == NV_FOS_FLASHINFER && v == 0.0f) ? 0u : (pick4 ? c4 : c6);
  return pick4 ? b4 : b6;
}

// Byte offset of scale (row r, block column c) of expert e in the 128x4 swizzled layout:
// nv_swizzle_row_base(e, r) + nv_swizzle_col(c), the row part computed once per row.
NV_HD int64_t nv_swizzle_row_base(int64_t e, int64_t r, int64_t rows, int64_t cols) {
  int64_t rp = (rows + 127) / 128 * 128, cp = (cols + 3) / 4 * 4;
  return e * rp * cp + (r / 128) * (cp / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4;
}

NV_HD int64_t nv_swizzle_col(int64_t c) { return (c / 4) * 512 + (c % 4); }

NV_HD int64_t nv_swizzle_offset(int64_t e, int64_t r, int64_t c, int64_t rows, int64_t cols) {
  return nv_swizzle_row_base(e, r, rows, cols) + nv_swizzle_col(c);
}

// --- MXFP4: E8M0 block scales (scale_math.e8m0_block_scales / _mx_encode) -------------------

// 2^n exactly, for n in [-149, 127] (below -126 a subnormal).
NV_HD float nv_exp2i(int n) {
  return n >= -126 ? nv_u2f(static_cast<uint32_t>(n + 127) << 23)
                   : nv_u2f(1u << (n + 149));
}

// The E8M0 byte of a 32-value block from its finite, non-negative fp32 maximum v, under an
// MX order. The torchao modes take v's biased exponent minus 127 and minus 2 (floor(log2 6)),
// clamped to bytes [0, 255]: mx_floor as is, mx_ceil one more when v's mantissa is not
// zero, mx_even after rounding v to one mantissa bit (bits + 2^21, mantissa cleared).
// mx_te is TE's float_to_e8m0 of the descale d = fl(v * fl(1/6)): d's exponent field,
// plus one when d's mantissa is not zero, except d's exponent 254 (saturates) and a
// subnormal d of mantissa <= 2^22 (rounds to byte 0).
NV_HD uint32_t nv_e8m0_byte(float v, int order) {
  uint32_t bits = nv_f2u(v);
  if (order == NV_ORDER_MX_TE) {
    const uint32_t d = nv_f2u(nv_mul(v, nv_u2f(0x3E2AAAABu)));  // fl(1/6)
    const uint32_t exp = d >> 23, man = d & 0x7FFFFFu;
    const uint32_t up = man > 0u && exp != 0xFEu && !(exp == 0u && man <= 0x400000u);
    return exp + up;
  }
  if (order == NV_ORDER_MX_EVEN) bits = (bits + (1u << 21)) & 0x7F800000u;
  int unbiased = static_cast<int>((bits >> 23) & 0xFFu) - 127;
  if (order == NV_ORDER_MX_CEIL) unbiased += (bits & 0x7FFFFFu) != 0u;
  int s = unbiased - 2;
  s = s < -127 ? -127 : (s > 128 ? 128 : s);
  return static_cast<uint32_t>(s + 127);
}

// The element multiplier of a block with E8M0 byte b: the spec divides by
// max(2^(b-127), 2^-126) (torchao modes) or multiplies by 1 / 2^(b-127), 1 for b = 0
// (mx_te). The divisor is a power of two, so x * 2^(127-b) is the same correctly
// rounded value as the division (subnormal results included: no flush to zero).
// Finite input never gives b = 255 (NaN), which would need an exponent past fp32's.
NV_HD float nv_mx_mult(uint32_t b, int order) {
  if (order == NV_ORDER_MX_TE) return b == 0u ? 1.0f : nv_exp2i(127 - static_cast<int>(b));
  return nv_exp2i(127 - static_cast<int>(b > 1u ? b : 1u));
}
