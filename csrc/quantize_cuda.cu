// CUDA kernel of libalign.spec.quantize for the te / torchao / modelopt orders (MXFP4:
// quantize_cuda_mx.h, one thread per 32-value block on the same encode step).
//
// One warp per row, two phases. Phase 1 streams the row from memory into shared memory
// (16-byte loads, coalesced) while taking its maximum on the integer bits of |x|, which
// order like the values and expose NaN/Inf in the same step. The warp reduces the row
// maximum and forms the outer scales (row domain) or reads them (tensor/expert domains,
// from nvfp4_amax_cuda plus the spec's formulas evaluated by the caller). Phase 2 gives
// each lane whole 16-element blocks from shared memory: the block maximum, the E4M3 scale
// byte (the hardware's round-to-nearest-even converter), one multiplier per block, then
// per element one multiply and the branch-free E2M1 rounding of nv_e2m1_mag, and
// 8 packed bytes stored at once. The input is read from memory once; only codes, scales
// and the row's outer scale are written.
//
// The work per element decides the speed (the kernel is limited by instruction issue well
// before memory bandwidth), so the kernel is specialised by input dtype, operation order
// and signed-zero policy, and the sign bits of a block are gathered from the input words
// with byte permutes: the scaled value has the sign of its input (every multiplier and
// divisor is positive or zero), so 'sign_of_input' takes them as they are and
// 'positive' keeps them where the magnitude code is not zero.
//
// 4-over-6 block scaling (te order; p.four_over_six) replaces phase 2's scale and encode
// of a block by fos_block: the shared scalar steps of nvfp4_math.h, as the CPU's scalar path.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "nvfp4_math.h"

namespace {

constexpr int kMaxWarpsPerCta = 8;
constexpr int kMaxStagedBytes = 96 * 1024;  // shared memory per CTA for staged rows

enum { SZ_FAST_POSITIVE = 0, SZ_FAST_INPUT = 1, SZ_GENERIC = 2 };

template <int DT>
struct Traits {
  static constexpr int kEpw = DT == NV_IN_FP32 ? 1 : 2;  // elements per 32-bit word
  static constexpr int kWpb = 16 / kEpw;                 // words per block
  static constexpr int kCpb = kWpb / 4;                  // 16-byte chunks per block
};

template <int DT>
__device__ __forceinline__ float word_elem(uint32_t w, int hi) {
  if constexpr (DT == NV_IN_FP32) return __uint_as_float(w);
  else if constexpr (DT == NV_IN_BF16) return __uint_as_float(hi ? (w & 0xFFFF0000u) : (w << 16));
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(hi ? (w >> 16) : (w & 0xFFFFu))));
}

// Running max of |x| bits over a 16-byte chunk (16-bit types: two halves per word).
template <int DT>
__device__ __forceinline__ uint32_t fold_absmax(uint32_t m, const uint4& v) {
  if constexpr (DT == NV_IN_FP32) {
    return max(max(m, max(v.x & 0x7FFFFFFFu, v.y & 0x7FFFFFFFu)),
               max(v.z & 0x7FFFFFFFu, v.w & 0x7FFFFFFFu));
  } else {
    return __vmaxu2(__vmaxu2(m, __vmaxu2(v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu)),
                    __vmaxu2(v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu));
  }
}

// fp32 bits of the folded maximum (>= 0x7F800000 when NaN/Inf was seen).
template <int DT>
__device__ __forceinline__ uint32_t finish_absmax(uint32_t m) {
  if constexpr (DT == NV_IN_FP32) return m;
  const uint32_t h = max(m & 0xFFFFu, m >> 16);
  if constexpr (DT == NV_IN_BF16) return h << 16;
  if (h >= 0x7C00u) return 0x7F800000u | h;
  return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
}

__device__ __forceinline__ uint32_t warp_max_bits(uint32_t m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return m;
}

__device__ __forceinline__ float saturate_elem(float v, float in_max) {
  if ((__float_as_uint(v) & 0x7F800000u) != 0x7F800000u) return v;
  return (v != v) ? 0.0f : (v > 0.0f ? in_max : -in_max);
}

// Largest |x| (fp32 bits) of this lane's chunks of a row after nonfinite='saturate'
// (rare path: only rows that hold NaN/Inf). `src` is the staged row or the input row.
template <int DT>
__device__ uint32_t saturated_absmax_bits(const uint4* src, int lane, int nchunks, float in_max) {
  constexpr int kEpw = Traits<DT>::kEpw;
  uint32_t m = 0;
  for (int c = lane; c < nchunks; c += 32) {
    const uint4 v = src[c];
    const uint32_t ww[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4 * kEpw; ++i) {
      const float e = saturate_elem(word_elem<DT>(ww[i / kEpw], i % kEpw), in_max);
      m = max(m, __float_as_uint(e) & 0x7FFFFFFFu);
    }
  }
  return m;
}

// nonfinite='saturate' at the bit level: NaN -> +0, +-Inf -> +-largest finite value of
// the input dtype, exactly what the spec's nan_to_num gives before widening.
__device__ __forceinline__ uint32_t sanitize16(uint32_t h, uint32_t exp_mask, uint32_t max_bits) {
  if ((h & exp_mask) != exp_mask) return h;
  if (h & (~exp_mask & 0x7FFFu)) return 0u;  // NaN
  return (h & 0x8000u) | max_bits;
}

template <int DT>
__device__ __forceinline__ void sanitize_words(uint32_t* w) {
#pragma unroll
  for (int i = 0; i < Traits<DT>::kWpb; ++i) {
    if constexpr (DT == NV_IN_FP32) {
      const uint32_t v = w[i];
      if ((v & 0x7F800000u) == 0x7F800000u)
        w[i] = (v & 0x007FFFFFu) ? 0u : ((v & 0x80000000u) | 0x7F7FFFFFu);
    } else {
      const uint32_t em = DT == NV_IN_BF16 ? 0x7F80u : 0x7C00u;
      const uint32_t mx = DT == NV_IN_BF16 ? 0x7F7Fu : 0x7BFFu;
      w[i] = sanitize16(w[i] & 0xFFFFu, em, mx) | (sanitize16(w[i] >> 16, em, mx) << 16);
    }
  }
}

// Sign bits of 8 consecutive 16-bit elements (words w[0..3]) at bit 3 of each nibble.
__device__ __forceinline__ uint32_t signs16(const uint32_t* w) {
  const uint32_t t01 = __byte_perm(w[0], w[1], 0x7351), t23 = __byte_perm(w[2], w[3], 0x7351);
  const uint32_t b1 = __byte_perm(t01, t23, 0x5410), b3 = __byte_perm(t01, t23, 0x7632);
  return ((b1 >> 4) & 0x08080808u) | (b3 & 0x80808080u);
}

// The E2M1 magnitude code of z (not NaN) plus 0x4B000000, mostly on the FMA pipe.
//
// With a = min(|z|, 6) the code is rint(2a) below 2, rint(a) + 2 from 2 to 4 and
// rint(a / 2) + 4 from 4 up (steps 0.5, 1, 2; rint rounds half to even, which is E2M1's
// even code); and it is the least of the three everywhere, since each formula overshoots
// outside its range. Each rint is one correctly rounded FMA against 2^23 (+2, +4: even
// offsets keep ties even), whose fp32 bits are 0x4B000000 + the integer, and positive
// floats order like their bits, so one three-way integer minimum picks the code. The
// integer pipe, this kernel's bottleneck, does two operations per element instead of
// the eight of nv_e2m1_mag.
__device__ __forceinline__ uint32_t e2m1_mag_biased(float z) {
  const float a = fminf(fabsf(z), NV_E2M1_MAX);
  const uint32_t r2 = __float_as_uint(__fmaf_rn(a, 2.0f, 8388608.0f));
  const uint32_t r1 = __float_as_uint(__fmaf_rn(a, 1.0f, 8388610.0f));
  const uint32_t rh = __float_as_uint(__fmaf_rn(a, 0.5f, 8388612.0f));
  return min(min(r2, r1), rh);
}

// sum over i < 8 of 0x4B000000 * 16^i, mod 2^32: the bias of eight packed biased codes.
constexpr uint32_t kPackedBias = 0x4B000000u + (0x4B000000u << 4) + (0x4B000000u << 8) +
                                 (0x4B000000u << 12) + (0x4B000000u << 16) +
                                 (0x4B000000u << 20) + (0x4B000000u << 24) +
                                 (0x4B000000u << 28);

// Encode 8 elements (words w) with one multiplier/divisor into one packed word.
template <int DT, int ORDER, int SZ>
__device__ __forceinline__ uint32_t encode8(const uint32_t* w, float mult, float div,
                                            bool use_div, float neg_above) {
  constexpr int kEpw = Traits<DT>::kEpw;
  uint32_t packed = 0;  // sum of (0x4B000000 + code) * 16^i: no carries between nibbles
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float x = word_elem<DT>(w[i / kEpw], i % kEpw);
    const float z = (ORDER == NV_ORDER_MODELOPT && use_div) ? __fdiv_rn(x, div) : __fmul_rn(x, mult);
    uint32_t code = e2m1_mag_biased(z);
    if constexpr (SZ == SZ_GENERIC) code += ((__float_as_uint(z) >> 31) & (fabsf(z) > neg_above)) << 3;
    packed += code * (1u << (4 * i));
  }
  packed -= kPackedBias;
  if constexpr (SZ != SZ_GENERIC) {
    uint32_t s;
    if constexpr (DT == NV_IN_FP32) {
      s = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) s |= (w[i] >> 31) << (4 * i + 3);
    } else {
      s = signs16(w);
    }
    if constexpr (SZ == SZ_FAST_POSITIVE) {
      // bit 3 of a nibble of packed + 0x77777777 is set iff its code (0..7) is not zero
      s &= packed + 0x77777777u;
    }
    packed |= s & 0x88888888u;
  }
  return packed;
}

// A 4-over-6 block (te order only): the shared scalar steps of nvfp4_math.h
// (nv_fos_block), which encode the block twice and keep the candidate with the smaller
// error summed in the spec's element order. One lane per block, as above. Not inlined: the
// kernels pass the widened block and the few parameters it reads by value, so the 72 te-order
// kernels share one copy of it and keep their own words in registers.
struct FosBlock { float x[16]; };

__device__ __noinline__ uint2 fos_block(FosBlock blk, float v, NvOuter o, float amax,
                                        float e4m3_max, int rule, int error, int signed_zero,
                                        uint8_t* scale) {
  NvParams p{};
  p.e4m3_max = e4m3_max;
  p.four_over_six = rule;
  p.four_over_six_error = error;
  p.signed_zero = signed_zero;
  uint64_t packed;
  *scale = nv_fos_block(blk.x, v, o, amax, p, &packed);
  return make_uint2(static_cast<uint32_t>(packed), static_cast<uint32_t>(packed >> 32));
}

template <int DT>
__device__ __forceinline__ void fos_store(const uint32_t* w, float v, NvOuter o, float amax,
                                          const NvParams& p, uint8_t* scale, uint2* out) {
  constexpr int kEpw = Traits<DT>::kEpw;
  FosBlock blk;
#pragma unroll
  for (int i = 0; i < 16; ++i) blk.x[i] = word_elem<DT>(w[i / kEpw], i % kEpw);
  __stcs(out, fos_block(blk, v, o, amax, p.e4m3_max, p.four_over_six, p.four_over_six_error,
                        p.signed_zero, scale));
}

template <int DT, int ORDER, int SZ, bool STAGED>
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32)
quantize_rows(const uint4* __restrict__ x, uint8_t* __restrict__ codes,
              uint8_t* __restrict__ scales, float* __restrict__ amax_out,
              float* __restrict__ stored_out, const float* __restrict__ enc_in,
              const float* __restrict__ dec_in, NvParams p, int* flags) {
  extern __shared__ uint4 staged[];
  constexpr int kCpb = Traits<DT>::kCpb, kWpb = Traits<DT>::kWpb;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpc = blockDim.x >> 5;
  const int64_t total = p.experts * p.rows;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * wpc + warp;
  if (r >= total) return;
  const int nb = static_cast<int>(p.k / 16), nchunks = nb * kCpb;
  const uint4* xr = p.gather ? static_cast<const uint4*>(p.gather[r / p.rows]) + (r % p.rows) * nchunks
                            : x + r * nchunks;
  uint4* srow = staged + (STAGED ? warp * nchunks : 0);

  // phase 1: stage the row, its maximum
  uint32_t m = 0;
#pragma unroll 4
  for (int c = lane; c < nchunks; c += 32) {
    const uint4 v = __ldcs(xr + c);
    if constexpr (STAGED) srow[c] = v;
    m = fold_absmax<DT>(m, v);
  }
  const uint32_t mine = finish_absmax<DT>(m);
  const bool bad = mine >= 0x7F800000u;
  const bool any_bad = __any_sync(0xFFFFFFFFu, bad);
  if (any_bad && !p.nonfinite_saturate) {
    if (lane == 0) atomicOr(flags, NV_FLAG_NONFINITE);
    return;
  }
  NvOuter o;
  float fos_amax = 0.0f;  // the outer maximum 4-over-6's errors scale by
  if (p.outer_mode == NV_OUTER_ROW) {
    uint32_t rm = mine;
    if (any_bad) rm = saturated_absmax_bits<DT>(STAGED ? srow : xr, lane, nchunks, p.in_max);
    float a = __uint_as_float(warp_max_bits(rm));
    if (p.has_amax_floor) a = nv_max(a, p.amax_floor);
    o = nv_outer_from_amax(a, ORDER, p.e4m3_max);
    fos_amax = a;
    if (lane == 0) {
      amax_out[r] = a;
      stored_out[r] = nv_stored(a, o, p);
    }
  } else {
    const int64_t i = p.outer_stride ? r / p.rows : 0;
    o.enc = enc_in[i];
    o.dec = dec_in[i];
    if (p.four_over_six != NV_FOS_OFF) fos_amax = amax_out[i];  // given: read, not written
  }
  if constexpr (STAGED) __syncwarp();

  // phase 2: whole blocks per lane
  const float te_mult = nv_te_block_mult(o.enc);
  const float neg_above = nv_neg_threshold(p.signed_zero);
  const int64_t e = r / p.rows, rr = r % p.rows;
  const int64_t scale_row = p.swizzled ? nv_swizzle_row_base(e, rr, p.rows, nb) : r * nb;
  uint2* crow = reinterpret_cast<uint2*>(codes + r * (p.k / 2));
  int local = 0;
#pragma unroll 1
  for (int b = lane; b < nb; b += 32) {
    uint32_t w[kWpb];
#pragma unroll
    for (int c = 0; c < kCpb; ++c) {
      const uint4 v = STAGED ? srow[b * kCpb + c] : __ldg(xr + b * kCpb + c);
      w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
    }
    uint32_t bm = 0;
#pragma unroll
    for (int c = 0; c < kCpb; ++c)
      bm = fold_absmax<DT>(bm, make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]));
    bm = finish_absmax<DT>(bm);
    if (any_bad && bm >= 0x7F800000u) {  // nonfinite='saturate' (rare path)
      sanitize_words<DT>(w);
      bm = 0;
#pragma unroll
      for (int c = 0; c < kCpb; ++c)
        bm = fold_absmax<DT>(bm, make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]));
      bm = finish_absmax<DT>(bm);
    }
    if constexpr (ORDER == NV_ORDER_TE) {
      if (p.four_over_six != NV_FOS_OFF) {
        fos_store<DT>(w, __uint_as_float(bm), o, fos_amax, p,
                      scales + scale_row + (p.swizzled ? nv_swizzle_col(b) : b), crow + b);
        continue;
      }
    }
    float pre = nv_block_prescale(__uint_as_float(bm), o, te_mult, ORDER);
    if (pre != pre) local |= NV_FLAG_UNDEFINED_SCALE;
    if (p.has_zero_prescale && pre == 0.0f) pre = p.zero_prescale_to;
    pre = fminf(fmaxf(pre, p.block_scale_floor), NV_E4M3_MAX);
    const uint8_t sb = static_cast<uint8_t>(__nv_cvt_float_to_fp8(pre, __NV_SATFINITE, __NV_E4M3));
    scales[scale_row + (p.swizzled ? nv_swizzle_col(b) : b)] = sb;
    const float s = nv_e4m3_value(sb);
    float mult = p.zero_saturate ? NV_FLT_MAX : 0.0f, div = 1.0f;
    bool use_div = false;
    if (s != 0.0f) {
      if constexpr (ORDER == NV_ORDER_TE) {
        mult = fminf(__frcp_rn(__fmul_rn(s, o.dec)), NV_FLT_MAX);
      } else if constexpr (ORDER == NV_ORDER_TORCHAO) {
        mult = __fdiv_rn(o.enc, s);
      } else {
        use_div = true;
        div = __fmul_rn(s, o.dec);
        if (div == 0.0f) local |= NV_FLAG_USE_SPEC;
      }
    }
    uint2 out;
    out.x = encode8<DT, ORDER, SZ>(w, mult, div, use_div, neg_above);
    out.y = encode8<DT, ORDER, SZ>(w + kWpb / 2, mult, div, use_div, neg_above);
    __stcs(crow + b, out);
  }
  if (local) atomicOr(flags, local);
}

// Register-resident variant: a group of G lanes (G = 1 << glog, up to a warp) holds one
// whole row in registers, each lane BPL blocks (block b = lane + G * i), so every load is
// issued before any arithmetic and nothing goes through shared memory. The row maximum is
// a shuffle reduction within the group. G and BPL are chosen on the host so that G * BPL
// covers the row's blocks with the least waste (K = 2048: 32 x 4; K = 768: 16 x 3).
// 4-over-6 blocks are not served here: their encode is a call (fos_block) whose argument
// passing and registers, carried by every kernel that can reach it, would cost this
// kernel about half its occupancy; the shared-memory kernel takes them.
template <int DT, int ORDER, int SZ, int BPL>
__global__ void __launch_bounds__(256)
quantize_rows_reg(const uint4* __restrict__ x, uint8_t* __restrict__ codes,
                  uint8_t* __restrict__ scales, float* __restrict__ amax_out,
                  float* __restrict__ stored_out, const float* __restrict__ enc_in,
                  const float* __restrict__ dec_in, NvParams p, int* flags, int glog) {
  constexpr int kCpb = Traits<DT>::kCpb, kWpb = Traits<DT>::kWpb;
  const int G = 1 << glog;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = gtid >> glog;
  const int64_t total = p.experts * p.rows;
  if (r >= total) return;  // whole groups leave together (groups never straddle rows)
  const int gl = threadIdx.x & (G - 1);
  const int lane = threadIdx.x & 31;
  const unsigned gmask = (G == 32) ? 0xFFFFFFFFu : (((1u << G) - 1u) << (lane & ~(G - 1)));
  const int nb = static_cast<int>(p.k / 16);
  const int64_t row_chunks = static_cast<int64_t>(nb) * kCpb;
  const uint4* xr = p.gather ? static_cast<const uint4*>(p.gather[r / p.rows]) + (r % p.rows) * row_chunks
                            : x + r * row_chunks;

  uint32_t w[BPL][kWpb];
#pragma unroll
  for (int i = 0; i < BPL; ++i) {
    const int b = gl + G * i;
#pragma unroll
    for (int c = 0; c < kCpb; ++c) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (b < nb) v = __ldg(xr + b * kCpb + c);
      w[i][4 * c] = v.x; w[i][4 * c + 1] = v.y; w[i][4 * c + 2] = v.z; w[i][4 * c + 3] = v.w;
    }
  }
  uint32_t bm[BPL];
  uint32_t mine = 0;
#pragma unroll
  for (int i = 0; i < BPL; ++i) {
    uint32_t m = 0;
#pragma unroll
    for (int c = 0; c < kCpb; ++c)
      m = fold_absmax<DT>(m, make_uint4(w[i][4 * c], w[i][4 * c + 1], w[i][4 * c + 2], w[i][4 * c + 3]));
    bm[i] = finish_absmax<DT>(m);
    mine = max(mine, bm[i]);
  }
  const bool any_bad = __any_sync(gmask, mine >= 0x7F800000u);
  if (any_bad && !p.nonfinite_saturate) {
    if (gl == 0) atomicOr(flags, NV_FLAG_NONFINITE);
    return;
  }
  if (any_bad) {  // nonfinite='saturate' (rare path): sanitize, then the maxima again
    mine = 0;
#pragma unroll
    for (int i = 0; i < BPL; ++i) {
      if (bm[i] >= 0x7F800000u) {
        sanitize_words<DT>(w[i]);
        uint32_t m = 0;
#pragma unroll
        for (int c = 0; c < kCpb; ++c)
          m = fold_absmax<DT>(m, make_uint4(w[i][4 * c], w[i][4 * c + 1], w[i][4 * c + 2], w[i][4 * c + 3]));
        bm[i] = finish_absmax<DT>(m);
      }
      mine = max(mine, bm[i]);
    }
  }
  NvOuter o;
  if (p.outer_mode == NV_OUTER_ROW) {
    uint32_t rm = mine;
    for (int off = G >> 1; off > 0; off >>= 1) rm = max(rm, __shfl_xor_sync(gmask, rm, off, G));
    float a = __uint_as_float(rm);
    if (p.has_amax_floor) a = nv_max(a, p.amax_floor);
    o = nv_outer_from_amax(a, ORDER, p.e4m3_max);
    if (gl == 0) {
      amax_out[r] = a;
      stored_out[r] = nv_stored(a, o, p);
    }
  } else {
    const int64_t i = p.outer_stride ? r / p.rows : 0;
    o.enc = enc_in[i];
    o.dec = dec_in[i];
  }
  const float te_mult = nv_te_block_mult(o.enc);
  const float neg_above = nv_neg_threshold(p.signed_zero);
  const int64_t e = r / p.rows, rr = r % p.rows;
  const int64_t scale_row = p.swizzled ? nv_swizzle_row_base(e, rr, p.rows, nb) : r * nb;
  uint2* crow = reinterpret_cast<uint2*>(codes + r * (p.k / 2));
  int local = 0;
#pragma unroll
  for (int i = 0; i < BPL; ++i) {
    const int b = gl + G * i;
    if (b >= nb) break;
    float pre = nv_block_prescale(__uint_as_float(bm[i]), o, te_mult, ORDER);
    if (pre != pre) local |= NV_FLAG_UNDEFINED_SCALE;
    if (p.has_zero_prescale && pre == 0.0f) pre = p.zero_prescale_to;
    pre = fminf(fmaxf(pre, p.block_scale_floor), NV_E4M3_MAX);
    const uint8_t sb = static_cast<uint8_t>(__nv_cvt_float_to_fp8(pre, __NV_SATFINITE, __NV_E4M3));
    scales[scale_row + (p.swizzled ? nv_swizzle_col(b) : b)] = sb;
    const float s = nv_e4m3_value(sb);
    float mult = p.zero_saturate ? NV_FLT_MAX : 0.0f, div = 1.0f;
    bool use_div = false;
    if (s != 0.0f) {
      if constexpr (ORDER == NV_ORDER_TE) {
        mult = fminf(__frcp_rn(__fmul_rn(s, o.dec)), NV_FLT_MAX);
      } else if constexpr (ORDER == NV_ORDER_TORCHAO) {
        mult = __fdiv_rn(o.enc, s);
      } else {
        use_div = true;
        div = __fmul_rn(s, o.dec);
        if (div == 0.0f) local |= NV_FLAG_USE_SPEC;
      }
    }
    uint2 out;
    out.x = encode8<DT, ORDER, SZ>(w[i], mult, div, use_div, neg_above);
    out.y = encode8<DT, ORDER, SZ>(w[i] + kWpb / 2, mult, div, use_div, neg_above);
    __stcs(crow + b, out);
  }
  if (local) atomicOr(flags, local);
}

// Blocks per lane the register variant is built for, and the most 16-byte chunks a lane
// may hold (64 registers of row data).
constexpr int kRegBpl[] = {1, 2, 3, 4, 6, 8};
constexpr int kMaxRegChunks = 16;
// 0: pick per shape; 1: always the shared-memory kernel; 2: the register one where it fits
// (nvfp4_cuda_set_variant, for the tests and the benchmark).
int g_variant = 0;

// (glog, bpl) of the register variant for nb blocks per row, or bpl 0 when none fits.
void reg_shape(int64_t nb, int cpb, int* glog, int* bpl) {
  *bpl = 0;
  int64_t best_waste = -1;
  for (int bp : kRegBpl) {
    if (bp * cpb > kMaxRegChunks) continue;
    for (int gl = 5; gl >= 0; --gl) {
      const int64_t slots = static_cast<int64_t>(bp) << gl;
      if (slots < nb) continue;
      const int64_t waste = slots - nb;
      // least waste; among equals the wider group (more lanes on one row)
      if (best_waste < 0 || waste < best_waste) { best_waste = waste; *glog = gl; *bpl = bp; }
    }
  }
  // a row that fills less than half of its lanes' slots stays with the shared-memory kernel
  if (*bpl && best_waste * 2 > (static_cast<int64_t>(*bpl) << *glog)) *bpl = 0;
}

template <int DT, int ORDER, int SZ, int BPL>
cudaError_t launch_reg(const uint4* xv, uint8_t* codes, uint8_t* scales, float* amax_out,
                       float* stored_out, const float* enc, const float* dec, const NvParams& p,
                       int* flags, cudaStream_t s, int glog) {
  const int64_t threads = (p.experts * p.rows) << glog;
  const dim3 grid(static_cast<unsigned>((threads + 255) / 256));
  quantize_rows_reg<DT, ORDER, SZ, BPL><<<grid, 256, 0, s>>>(xv, codes, scales, amax_out,
                                                              stored_out, enc, dec, p, flags, glog);
  return cudaGetLastError();
}

// Per-expert max |x| (non-negative floats order like their bit patterns).
template <int DT>
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32)
amax_rows(const uint4* __restrict__ x, float* amax_out, NvParams p, int* flags) {
  const int lane = threadIdx.x & 31;
  const int64_t total = p.experts * p.rows;
  const int nchunks = static_cast<int>(p.k / 16) * Traits<DT>::kCpb;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kMaxWarpsPerCta + (threadIdx.x >> 5);
  if (r >= total) return;
  const uint4* xr = x + r * nchunks;
  uint32_t m = 0;
#pragma unroll 4
  for (int c = lane; c < nchunks; c += 32) m = fold_absmax<DT>(m, __ldcs(xr + c));
  uint32_t mine = finish_absmax<DT>(m);
  const bool bad = mine >= 0x7F800000u;
  if (__any_sync(0xFFFFFFFFu, bad)) {
    if (!p.nonfinite_saturate) {
      if (lane == 0) atomicOr(flags, NV_FLAG_NONFINITE);
      return;
    }
    mine = saturated_absmax_bits<DT>(xr, lane, nchunks, p.in_max);
  }
  const uint32_t rm = warp_max_bits(mine);
  if (lane == 0) atomicMax(reinterpret_cast<unsigned int*>(amax_out) + r / p.rows, rm);
}

template <int DT, int ORDER, int SZ>
cudaError_t launch3(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                    float* stored_out, const float* enc, const float* dec, const NvParams& p,
                    int* flags, cudaStream_t s) {
  const int64_t total = p.experts * p.rows;
  const int64_t row_bytes = p.k * (DT == NV_IN_FP32 ? 4 : 2);
  const uint4* xv = static_cast<const uint4*>(x);
  if (g_variant != 1 && p.four_over_six == NV_FOS_OFF) {
    int glog = 0, bpl = 0;
    reg_shape(p.k / 16, Traits<DT>::kCpb, &glog, &bpl);
    switch (bpl) {
      case 1: return launch_reg<DT, ORDER, SZ, 1>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags, s, glog);
      case 2: return launch_reg<DT, ORDER, SZ, 2>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags, s, glog);
      case 3: return launch_reg<DT, ORDER, SZ, 3>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags, s, glog);
      case 4: return launch_reg<DT, ORDER, SZ, 4>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags, s, glog);
      case 6: if constexpr (Traits<DT>::kCpb * 6 <= kMaxRegChunks)
                return launch_reg<DT, ORDER, SZ, 6>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags, s, glog);
              break;
      case 8: if constexpr (Traits<DT>::kCpb * 8 <= kMaxRegChunks)
                return launch_reg<DT, ORDER, SZ, 8>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags, s, glog);
              break;
      default: break;
    }
  }
  if (row_bytes <= kMaxStagedBytes) {
    const int wpc = static_cast<int>(std::min<int64_t>(kMaxWarpsPerCta, kMaxStagedBytes / row_bytes));
    const size_t smem = static_cast<size_t>(wpc * row_bytes);
    auto kern = quantize_rows<DT, ORDER, SZ, true>;
    static bool raised = false;  // one attribute call per instantiation
    if (!raised) {
      cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxStagedBytes);
      if (err != cudaSuccess) return err;
      raised = true;
    }
    const dim3 grid(static_cast<unsigned>((total + wpc - 1) / wpc));
    kern<<<grid, wpc * 32, smem, s>>>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags);
  } else {
    const dim3 grid(static_cast<unsigned>((total + kMaxWarpsPerCta - 1) / kMaxWarpsPerCta));
    quantize_rows<DT, ORDER, SZ, false><<<grid, kMaxWarpsPerCta * 32, 0, s>>>(
        xv, codes, scales, amax_out, stored_out, enc, dec, p, flags);
  }
  return cudaGetLastError();
}

template <int DT, int ORDER>
cudaError_t launch2(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                    float* stored_out, const float* enc, const float* dec, const NvParams& p,
                    int* flags, cudaStream_t s) {
  if (p.signed_zero == NV_SZ_POSITIVE)
    return launch3<DT, ORDER, SZ_FAST_POSITIVE>(x, codes, scales, amax_out, stored_out, enc, dec, p, flags, s);
  if (p.signed_zero == NV_SZ_SIGN_OF_INPUT)
    return launch3<DT, ORDER, SZ_FAST_INPUT>(x, codes, scales, amax_out, stored_out, enc, dec, p, flags, s);
  return launch3<DT, ORDER, SZ_GENERIC>(x, codes, scales, amax_out, stored_out, enc, dec, p, flags, s);
}

template <int DT>
cudaError_t launch1(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                    float* stored_out, const float* enc, const float* dec, const NvParams& p,
                    int* flags, cudaStream_t s) {
  switch (p.op_order) {
    case NV_ORDER_TE: return launch2<DT, NV_ORDER_TE>(x, codes, scales, amax_out, stored_out, enc, dec, p, flags, s);
    case NV_ORDER_TORCHAO: return launch2<DT, NV_ORDER_TORCHAO>(x, codes, scales, amax_out, stored_out, enc, dec, p, flags, s);
    case NV_ORDER_MODELOPT: return launch2<DT, NV_ORDER_MODELOPT>(x, codes, scales, amax_out, stored_out, enc, dec, p, flags, s);
    default: return cudaErrorInvalidValue;
  }
}

#include "quantize_cuda_mx.h"  // MXFP4 (the MX op_orders), on encode8 above

}  // namespace

extern "C" {

int nvfp4_quantize_cuda(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                        float* stored_out, const float* enc, const float* dec,
                        const NvParams* p, int* flags_dev, void* stream) {
  if (p->k % (NV_IS_MX(p->op_order) ? 32 : 16) != 0) return -1;
  if (p->gather && (NV_IS_MX(p->op_order) || p->outer_mode != NV_OUTER_ROW || p->swizzled))
    return -3;
  if (p->experts * p->rows == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (NV_IS_MX(p->op_order))
    return static_cast<int>(launch_mx(x, codes, scales, *p, flags_dev, s));
  cudaError_t err;
  switch (p->in_dtype) {
    case NV_IN_BF16: err = launch1<NV_IN_BF16>(x, codes, scales, amax_out, stored_out, enc, dec, *p, flags_dev, s); break;
    case NV_IN_FP16: err = launch1<NV_IN_FP16>(x, codes, scales, amax_out, stored_out, enc, dec, *p, flags_dev, s); break;
    case NV_IN_FP32: err = launch1<NV_IN_FP32>(x, codes, scales, amax_out, stored_out, enc, dec, *p, flags_dev, s); break;
    default: return -2;
  }
  return static_cast<int>(err);
}

int nvfp4_cuda_set_variant(int variant) {
  if (variant < 0 || variant > 2) return -1;
  g_variant = variant;
  return 0;
}

int nvfp4_amax_cuda(const void* x, float* amax_out, const NvParams* p, int* flags_dev,
                    void* stream) {
  if (p->k % 16 != 0) return -1;
  if (p->gather) return -3;
  const int64_t total = p->experts * p->rows;
  if (total == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>((total + kMaxWarpsPerCta - 1) / kMaxWarpsPerCta));
  const dim3 block(kMaxWarpsPerCta * 32);
  const uint4* xv = static_cast<const uint4*>(x);
  switch (p->in_dtype) {
    case NV_IN_BF16: amax_rows<NV_IN_BF16><<<grid, block, 0, s>>>(xv, amax_out, *p, flags_dev); break;
    case NV_IN_FP16: amax_rows<NV_IN_FP16><<<grid, block, 0, s>>>(xv, amax_out, *p, flags_dev); break;
    case NV_IN_FP32: amax_rows<NV_IN_FP32><<<grid, block, 0, s>>>(xv, amax_out, *p, flags_dev); break;
    default: return -2;
  }
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
