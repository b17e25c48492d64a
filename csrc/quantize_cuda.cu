// CUDA kernel of libalign.spec.quantize for the te / torchao / modelopt orders.
//
// One warp per row. Each lane loads 16-byte chunks (8 bf16/fp16 or 4 fp32 elements), so
// a 16-element block lives in 2 (or 4) neighbouring lanes and its maximum is one or two
// shuffles away. In the row domain the warp reduces the row maximum, forms the outer
// scales, and every lane then encodes its chunks into 4 (or 2) packed bytes: the input is
// read once from memory and nothing but codes, scales and the row's outer scale is
// written. Rows up to 32*16 chunks stay in registers between the two steps; longer rows
// are read twice, the second time from cache. The tensor and expert domains take their
// outer scales from a per-expert amax pass (nvfp4_amax_cuda) and the spec's outer-scale
// formulas, which the caller evaluates on the device.
//
// The kernel is bound by instruction issue, not memory, unless the per-element work is
// small, so the inner loop is lean: the maximum is taken on the integer bits of |x| (which
// order like the values, and expose NaN/Inf in the same step), the E4M3 scale byte comes
// from the hardware's round-to-nearest-even converter, and each element costs one scale
// multiply plus the branch-free E2M1 rounding of nv_e2m1_code_fast.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "nvfp4_math.h"

namespace {

constexpr int kWarpsPerCta = 8;

template <int DT>
struct Traits {
  static constexpr int kEpc = DT == NV_IN_FP32 ? 4 : 8;  // elements per 16-byte chunk
  static constexpr int kLpb = 16 / kEpc;                 // lanes per 16-element block
};

template <int DT>
__device__ __forceinline__ void widen(const uint4& raw, float (&v)[Traits<DT>::kEpc]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (DT == NV_IN_FP32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(w[i]);
  } else if constexpr (DT == NV_IN_BF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
}

// Largest |x| of a chunk as fp32 bits (>= 0x7F800000 when the chunk holds NaN or Inf).
template <int DT>
__device__ __forceinline__ uint32_t chunk_absmax_bits(const uint4& raw) {
  if constexpr (DT == NV_IN_FP32) {
    uint32_t m = max(max(raw.x & 0x7FFFFFFFu, raw.y & 0x7FFFFFFFu),
                     max(raw.z & 0x7FFFFFFFu, raw.w & 0x7FFFFFFFu));
    return m;
  } else {
    // two 16-bit magnitudes per word, compared as unsigned halves
    uint32_t m = __vmaxu2(__vmaxu2(raw.x & 0x7FFF7FFFu, raw.y & 0x7FFF7FFFu),
                          __vmaxu2(raw.z & 0x7FFF7FFFu, raw.w & 0x7FFF7FFFu));
    uint32_t h = max(m & 0xFFFFu, m >> 16);
    if constexpr (DT == NV_IN_BF16) {
      return h << 16;
    } else {  // fp16 bits -> fp32 bits of the same value (NaN/Inf -> 0x7F800000 or above)
      if (h >= 0x7C00u) return 0x7F800000u | (h & 0x3FFu);
      return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
    }
  }
}

template <int DT>
__device__ __forceinline__ uint32_t block_max_bits(uint32_t m) {
  m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
  if constexpr (Traits<DT>::kLpb == 4) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
  return m;
}

__device__ __forceinline__ uint32_t warp_max_bits(uint32_t m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return m;
}

__device__ __forceinline__ bool bits_nonfinite(uint32_t b) { return b >= 0x7F800000u; }

// E4M3 byte of a clamped value in [0, 448] via the hardware converter (RNE, like
// nv_e4m3_bits; the values are in range so saturation never acts).
__device__ __forceinline__ uint8_t e4m3_hw(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Saturate NaN/Inf of a widened chunk (nonfinite='saturate' only; rare path).
template <int DT>
__device__ __forceinline__ void saturate_chunk(float (&v)[Traits<DT>::kEpc], float in_max) {
#pragma unroll
  for (int i = 0; i < Traits<DT>::kEpc; ++i) {
    if ((__float_as_uint(v[i]) & 0x7F800000u) == 0x7F800000u)
      v[i] = (v[i] != v[i]) ? 0.0f : (v[i] > 0.0f ? in_max : -in_max);
  }
}

// Block scale byte, then the chunk's packed codes; the block's first lane stores the byte.
template <int DT>
__device__ __forceinline__ void encode_chunk(const uint4& raw, float bmax, bool sat, int64_t r,
                                             int c, NvOuter o, float te_mult, float neg_above,
                                             const NvParams& p, uint8_t* codes,
                                             uint8_t* scales, int* flags_local) {
  constexpr int kEpc = Traits<DT>::kEpc, kLpb = Traits<DT>::kLpb;
  const int64_t nb = p.k / 16;
  float pre = nv_block_prescale(bmax, o, te_mult, p.op_order);
  if (pre != pre) *flags_local |= NV_FLAG_UNDEFINED_SCALE;
  if (p.has_zero_prescale && pre == 0.0f) pre = p.zero_prescale_to;
  pre = fminf(fmaxf(pre, p.block_scale_floor), NV_E4M3_MAX);
  const uint8_t sb = e4m3_hw(pre);
  if (c % kLpb == 0) {
    const int b = c / kLpb;
    const int64_t e = r / p.rows, rr = r % p.rows;
    if (p.swizzled) scales[nv_swizzle_offset(e, rr, b, p.rows, nb)] = sb;
    else scales[r * nb + b] = sb;
  }
  const float s = nv_e4m3_value(sb);
  float v[kEpc];
  widen<DT>(raw, v);
  if (sat) saturate_chunk<DT>(v, p.in_max);
  uint32_t packed = 0;
  if (p.op_order == NV_ORDER_MODELOPT && s != 0.0f) {
    const float div = __fmul_rn(s, o.dec);
    if (div == 0.0f) *flags_local |= NV_FLAG_USE_SPEC;
#pragma unroll
    for (int i = 0; i < kEpc; ++i)
      packed |= nv_e2m1_code_fast(__fdiv_rn(v[i], div), neg_above) << (4 * i);
  } else {
    float mult;
    if (s == 0.0f) mult = p.zero_saturate ? NV_FLT_MAX : 0.0f;
    else if (p.op_order == NV_ORDER_TE) mult = fminf(__frcp_rn(__fmul_rn(s, o.dec)), NV_FLT_MAX);
    else mult = __fdiv_rn(o.enc, s);
#pragma unroll
    for (int i = 0; i < kEpc; ++i)
      packed |= nv_e2m1_code_fast(__fmul_rn(v[i], mult), neg_above) << (4 * i);
  }
  uint8_t* dst = codes + r * (p.k / 2) + static_cast<int64_t>(c) * (kEpc / 2);
  if constexpr (kEpc == 8) __stcs(reinterpret_cast<unsigned int*>(dst), packed);
  else __stcs(reinterpret_cast<unsigned short*>(dst), static_cast<unsigned short>(packed));
}

__device__ __forceinline__ NvOuter row_outer(uint32_t rowmax_bits, int64_t r, int lane,
                                             const NvParams& p, const float* enc,
                                             const float* dec, float* amax_out,
                                             float* stored_out) {
  NvOuter o;
  if (p.outer_mode == NV_OUTER_ROW) {
    float a = __uint_as_float(warp_max_bits(rowmax_bits));
    if (p.has_amax_floor) a = nv_max(a, p.amax_floor);
    o = nv_outer_from_amax(a, p.op_order);
    if (lane == 0) {
      amax_out[r] = a;
      stored_out[r] = nv_stored(a, o, p.store_conv);
    }
  } else {
    const int64_t i = p.outer_stride ? r / p.rows : 0;
    o.enc = enc[i];
    o.dec = dec[i];
  }
  return o;
}

// Exact block maximum of a chunk that held NaN/Inf, after saturation.
template <int DT>
__device__ __forceinline__ uint32_t saturated_chunk_max_bits(const uint4& raw, float in_max) {
  float v[Traits<DT>::kEpc];
  widen<DT>(raw, v);
  saturate_chunk<DT>(v, in_max);
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < Traits<DT>::kEpc; ++i) m = max(m, __float_as_uint(v[i]) & 0x7FFFFFFFu);
  return m;
}

// Rows of at most 32*CPT chunks: the row stays in registers between the two steps.
template <int DT, int CPT>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
quantize_rows_reg(const uint4* __restrict__ x, uint8_t* __restrict__ codes,
                  uint8_t* __restrict__ scales, float* amax_out, float* stored_out,
                  const float* enc, const float* dec, NvParams p, int* flags) {
  const int lane = threadIdx.x & 31;
  const int64_t total = p.experts * p.rows;
  const int nchunks = static_cast<int>(p.k / Traits<DT>::kEpc);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (r >= total) return;
  const uint4* xr = x + r * nchunks;
  uint4 raw[CPT];
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = i * 32 + lane;
    if (c < nchunks) raw[i] = __ldcs(xr + c);
  }
  uint32_t cmax[CPT];
  bool bad = false;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = i * 32 + lane;
    cmax[i] = c < nchunks ? chunk_absmax_bits<DT>(raw[i]) : 0u;
    if (bits_nonfinite(cmax[i])) {
      bad = true;
      if (p.nonfinite_saturate) cmax[i] = saturated_chunk_max_bits<DT>(raw[i], p.in_max);
    }
  }
  if (__any_sync(0xFFFFFFFFu, bad) && !p.nonfinite_saturate) {
    if (lane == 0) atomicOr(flags, NV_FLAG_NONFINITE);
    return;
  }
  uint32_t rowmax = 0;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    if (i * 32 < nchunks) cmax[i] = block_max_bits<DT>(cmax[i]);  // whole warp takes part
    rowmax = max(rowmax, cmax[i]);
  }
  const NvOuter o = row_outer(rowmax, r, lane, p, enc, dec, amax_out, stored_out);
  const float te_mult = nv_te_block_mult(o.enc);
  const float neg_above = nv_neg_threshold(p.signed_zero);
  int local = 0;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = i * 32 + lane;
    if (c < nchunks)
      encode_chunk<DT>(raw[i], __uint_as_float(cmax[i]), bad, r, c, o, te_mult, neg_above, p,
                       codes, scales, &local);
  }
  if (local) atomicOr(flags, local);
}

// Any row length: the row maximum first, then a second (cached) read to encode.
template <int DT>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
quantize_rows_stream(const uint4* __restrict__ x, uint8_t* __restrict__ codes,
                     uint8_t* __restrict__ scales, float* amax_out, float* stored_out,
                     const float* enc, const float* dec, NvParams p, int* flags) {
  const int lane = threadIdx.x & 31;
  const int64_t total = p.experts * p.rows;
  const int nchunks = static_cast<int>(p.k / Traits<DT>::kEpc);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (r >= total) return;
  const uint4* xr = x + r * nchunks;
  bool bad = false;
  uint32_t rowmax = 0;
  for (int c = lane; c < nchunks; c += 32) {
    const uint4 raw = __ldg(xr + c);
    uint32_t m = chunk_absmax_bits<DT>(raw);
    if (bits_nonfinite(m)) {
      bad = true;
      if (p.nonfinite_saturate) m = saturated_chunk_max_bits<DT>(raw, p.in_max);
    }
    rowmax = max(rowmax, m);
  }
  if (__any_sync(0xFFFFFFFFu, bad) && !p.nonfinite_saturate) {
    if (lane == 0) atomicOr(flags, NV_FLAG_NONFINITE);
    return;
  }
  const NvOuter o = row_outer(rowmax, r, lane, p, enc, dec, amax_out, stored_out);
  const float te_mult = nv_te_block_mult(o.enc);
  const float neg_above = nv_neg_threshold(p.signed_zero);
  int local = 0;
  for (int base = 0; base < nchunks; base += 32) {
    const int c = base + lane;
    uint4 raw = make_uint4(0, 0, 0, 0);
    uint32_t m = 0;
    bool sat = false;
    if (c < nchunks) {
      raw = __ldg(xr + c);
      m = chunk_absmax_bits<DT>(raw);
      if (bits_nonfinite(m)) {
        sat = true;
        m = saturated_chunk_max_bits<DT>(raw, p.in_max);
      }
    }
    m = block_max_bits<DT>(m);
    if (c < nchunks)
      encode_chunk<DT>(raw, __uint_as_float(m), sat, r, c, o, te_mult, neg_above, p, codes,
                       scales, &local);
  }
  if (local) atomicOr(flags, local);
}

// Per-expert max |x| (non-negative floats order like their bit patterns).
template <int DT>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
amax_rows(const uint4* __restrict__ x, float* amax_out, NvParams p, int* flags) {
  const int lane = threadIdx.x & 31;
  const int64_t total = p.experts * p.rows;
  const int nchunks = static_cast<int>(p.k / Traits<DT>::kEpc);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (r >= total) return;
  const uint4* xr = x + r * nchunks;
  bool bad = false;
  uint32_t m = 0;
  for (int c = lane; c < nchunks; c += 32) {
    const uint4 raw = __ldcs(xr + c);
    uint32_t cm = chunk_absmax_bits<DT>(raw);
    if (bits_nonfinite(cm)) {
      bad = true;
      if (p.nonfinite_saturate) cm = saturated_chunk_max_bits<DT>(raw, p.in_max);
    }
    m = max(m, cm);
  }
  m = warp_max_bits(m);
  if (__any_sync(0xFFFFFFFFu, bad) && !p.nonfinite_saturate) {
    if (lane == 0) atomicOr(flags, NV_FLAG_NONFINITE);
    return;
  }
  if (lane == 0) atomicMax(reinterpret_cast<unsigned int*>(amax_out) + r / p.rows, m);
}

template <int DT>
cudaError_t launch_quantize(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                            float* stored_out, const float* enc, const float* dec,
                            const NvParams& p, int* flags, cudaStream_t s) {
  const int64_t total = p.experts * p.rows;
  if (total == 0) return cudaSuccess;
  const int nchunks = static_cast<int>(p.k / Traits<DT>::kEpc);
  const int cpt = (nchunks + 31) / 32;
  const dim3 grid(static_cast<unsigned>((total + kWarpsPerCta - 1) / kWarpsPerCta));
  const dim3 block(kWarpsPerCta * 32);
  const uint4* xv = static_cast<const uint4*>(x);
#define NV_LAUNCH(CPT) \
  quantize_rows_reg<DT, CPT><<<grid, block, 0, s>>>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags)
  if (cpt <= 1) NV_LAUNCH(1);
  else if (cpt <= 2) NV_LAUNCH(2);
  else if (cpt <= 3) NV_LAUNCH(3);
  else if (cpt <= 4) NV_LAUNCH(4);
  else if (cpt <= 8) NV_LAUNCH(8);
  else if (cpt <= 16) NV_LAUNCH(16);
  else quantize_rows_stream<DT><<<grid, block, 0, s>>>(xv, codes, scales, amax_out, stored_out, enc, dec, p, flags);
#undef NV_LAUNCH
  return cudaGetLastError();
}

}  // namespace

extern "C" {

int nvfp4_quantize_cuda(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                        float* stored_out, const float* enc, const float* dec,
                        const NvParams* p, int* flags_dev, void* stream) {
  if (p->k % 16 != 0) return -1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  switch (p->in_dtype) {
    case NV_IN_BF16: err = launch_quantize<NV_IN_BF16>(x, codes, scales, amax_out, stored_out, enc, dec, *p, flags_dev, s); break;
    case NV_IN_FP16: err = launch_quantize<NV_IN_FP16>(x, codes, scales, amax_out, stored_out, enc, dec, *p, flags_dev, s); break;
    case NV_IN_FP32: err = launch_quantize<NV_IN_FP32>(x, codes, scales, amax_out, stored_out, enc, dec, *p, flags_dev, s); break;
    default: return -2;
  }
  return static_cast<int>(err);
}

int nvfp4_amax_cuda(const void* x, float* amax_out, const NvParams* p, int* flags_dev,
                    void* stream) {
  if (p->k % 16 != 0) return -1;
  const int64_t total = p->experts * p->rows;
  if (total == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>((total + kWarpsPerCta - 1) / kWarpsPerCta));
  const dim3 block(kWarpsPerCta * 32);
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
