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
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
      __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
      float2 f = __half22float2(h);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
}

__device__ __forceinline__ bool is_finite_bits(float v) {
  return (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u;
}

// Widen a chunk, saturating NaN/Inf when asked; returns max |v| and sets *bad on NaN/Inf.
template <int DT>
__device__ __forceinline__ float chunk_values(const uint4& raw, const NvParams& p,
                                              float (&v)[Traits<DT>::kEpc], bool* bad) {
  widen<DT>(raw, v);
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < Traits<DT>::kEpc; ++i) {
    if (!is_finite_bits(v[i])) {
      *bad = true;
      v[i] = (v[i] != v[i]) ? 0.0f : (v[i] > 0.0f ? p.in_max : -p.in_max);
    }
    m = fmaxf(m, fabsf(v[i]));
  }
  return m;
}

template <int DT>
__device__ __forceinline__ float block_max(float m) {
  m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
  if constexpr (Traits<DT>::kLpb == 4) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
  return m;
}

__device__ __forceinline__ float warp_max(float m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return m;
}

// Scale byte of the chunk's block (written by the block's first lane) and its packed codes.
template <int DT>
__device__ __forceinline__ void encode_chunk(const float (&v)[Traits<DT>::kEpc], float bmax,
                                             int64_t r, int c, NvOuter o, float te_mult,
                                             const NvParams& p, uint8_t* codes,
                                             uint8_t* scales, int* undefined) {
  constexpr int kEpc = Traits<DT>::kEpc, kLpb = Traits<DT>::kLpb;
  const int64_t nb = p.k / 16;
  const int b = c / kLpb;
  uint8_t sb = nv_block_scale(bmax, o, te_mult, p, undefined);
  if (c % kLpb == 0) {
    const int64_t e = r / p.rows, rr = r % p.rows;
    if (p.swizzled) scales[nv_swizzle_offset(e, rr, b, p.rows, nb)] = sb;
    else scales[r * nb + b] = sb;
  }
  NvEnc enc = nv_element_encoder(nv_e4m3_value(sb), o, p);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < kEpc; ++i) packed |= nv_e2m1_code(v[i], enc, p.signed_zero) << (4 * i);
  uint8_t* dst = codes + r * (p.k / 2) + static_cast<int64_t>(c) * (kEpc / 2);
  if constexpr (kEpc == 8) __stcs(reinterpret_cast<unsigned int*>(dst), packed);
  else __stcs(reinterpret_cast<unsigned short*>(dst), static_cast<unsigned short>(packed));
}

__device__ __forceinline__ NvOuter row_outer(float rowmax, int64_t r, int lane, const NvParams& p,
                                             const float* enc, const float* dec,
                                             float* amax_out, float* stored_out) {
  NvOuter o;
  if (p.outer_mode == NV_OUTER_ROW) {
    float a = warp_max(rowmax);
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

// Rows of at most 32*CPT chunks: the row stays in registers between the two steps.
template <int DT, int CPT>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
quantize_rows_reg(const uint4* __restrict__ x, uint8_t* __restrict__ codes,
                  uint8_t* __restrict__ scales, float* amax_out, float* stored_out,
                  const float* enc, const float* dec, NvParams p, int* flags) {
  constexpr int kEpc = Traits<DT>::kEpc;
  const int lane = threadIdx.x & 31;
  const int64_t total = p.experts * p.rows;
  const int nchunks = static_cast<int>(p.k / kEpc);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (r >= total) return;
  const uint4* xr = x + r * nchunks;
  uint4 raw[CPT];
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = i * 32 + lane;
    if (c < nchunks) raw[i] = __ldcs(xr + c);
  }
  float bmax[CPT];
  bool bad = false;
  float rowmax = 0.0f;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = i * 32 + lane;
    float v[kEpc];
    float m = 0.0f;
    if (c < nchunks) m = chunk_values<DT>(raw[i], p, v, &bad);
    if (i * 32 < nchunks) m = block_max<DT>(m);  // whole warp takes part
    bmax[i] = m;
    rowmax = fmaxf(rowmax, m);
  }
  if (__any_sync(0xFFFFFFFFu, bad) && !p.nonfinite_saturate) {
    if (lane == 0) atomicOr(flags, NV_FLAG_NONFINITE);
    return;
  }
  const NvOuter o = row_outer(rowmax, r, lane, p, enc, dec, amax_out, stored_out);
  const float te_mult = nv_te_block_mult(o.enc);
  int undefined = 0;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = i * 32 + lane;
    if (c < nchunks) {
      float v[kEpc];
      bool ignored = false;
      chunk_values<DT>(raw[i], p, v, &ignored);
      encode_chunk<DT>(v, bmax[i], r, c, o, te_mult, p, codes, scales, &undefined);
    }
  }
  if (undefined) atomicOr(flags, NV_FLAG_UNDEFINED_SCALE);
}

// Any row length: the row maximum first, then a second (cached) read to encode.
template <int DT>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
quantize_rows_stream(const uint4* __restrict__ x, uint8_t* __restrict__ codes,
                     uint8_t* __restrict__ scales, float* amax_out, float* stored_out,
                     const float* enc, const float* dec, NvParams p, int* flags) {
  constexpr int kEpc = Traits<DT>::kEpc;
  const int lane = threadIdx.x & 31;
  const int64_t total = p.experts * p.rows;
  const int nchunks = static_cast<int>(p.k / kEpc);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (r >= total) return;
  const uint4* xr = x + r * nchunks;
  bool bad = false;
  float rowmax = 0.0f;
  for (int base = 0; base < nchunks; base += 32) {
    const int c = base + lane;
    float v[kEpc];
    if (c < nchunks) rowmax = fmaxf(rowmax, chunk_values<DT>(__ldg(xr + c), p, v, &bad));
  }
  if (__any_sync(0xFFFFFFFFu, bad) && !p.nonfinite_saturate) {
    if (lane == 0) atomicOr(flags, NV_FLAG_NONFINITE);
    return;
  }
  const NvOuter o = row_outer(rowmax, r, lane, p, enc, dec, amax_out, stored_out);
  const float te_mult = nv_te_block_mult(o.enc);
  int undefined = 0;
  for (int base = 0; base < nchunks; base += 32) {
    const int c = base + lane;
    float v[kEpc];
    bool ignored = false;
    float m = 0.0f;
    if (c < nchunks) m = chunk_values<DT>(__ldg(xr + c), p, v, &ignored);
    m = block_max<DT>(m);
    if (c < nchunks) encode_chunk<DT>(v, m, r, c, o, te_mult, p, codes, scales, &undefined);
  }
  if (undefined) atomicOr(flags, NV_FLAG_UNDEFINED_SCALE);
}

// Per-expert max |x| (non-negative floats order like their bit patterns).
template <int DT>
__global__ void amax_rows(const uint4* __restrict__ x, float* amax_out, NvParams p, int* flags) {
  constexpr int kEpc = Traits<DT>::kEpc;
  const int lane = threadIdx.x & 31;
  const int64_t total = p.experts * p.rows;
  const int nchunks = static_cast<int>(p.k / kEpc);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (r >= total) return;
  const uint4* xr = x + r * nchunks;
  bool bad = false;
  float m = 0.0f;
  for (int c = lane; c < nchunks; c += 32) {
    float v[kEpc];
    m = fmaxf(m, chunk_values<DT>(__ldcs(xr + c), p, v, &bad));
  }
  m = warp_max(m);
  if (__any_sync(0xFFFFFFFFu, bad) && !p.nonfinite_saturate) {
    if (lane == 0) atomicOr(flags, NV_FLAG_NONFINITE);
    return;
  }
  if (lane == 0) atomicMax(reinterpret_cast<unsigned int*>(amax_out) + r / p.rows, __float_as_uint(m));
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
