// MXFP4 on CUDA: E2M1 codes with one E8M0 scale byte per 32 values, no outer scale.
//
// Not a standalone header: quantize_cuda.cu includes it inside its anonymous namespace,
// after the NVFP4 helpers it reuses (Traits, fold_absmax, finish_absmax, sanitize_words,
// encode8). An MXFP4 block depends on nothing outside its 32 values (no row or tensor
// maximum), so the kernel is one thread per block, grid-wide: the thread loads its block
// (64 bytes of bf16/fp16, 128 of fp32), takes the maximum on the integer bits of |x|
// (NaN/Inf show up as the largest), forms the E8M0 byte and the power-of-two multiplier
// of nv_e8m0_byte / nv_mx_mult (nvfp4_math.h, shared with the CPU kernel), and encodes
// the 32 values with the NVFP4 kernels' encode8 (a multiply, the branch-free E2M1
// rounding, the signed-zero policy), storing 16 code bytes and one scale byte. Adjacent
// threads read adjacent blocks, so a warp reads one contiguous span.

template <int DT, int SZ>
__global__ void __launch_bounds__(256)
quantize_mx_blocks(const uint4* __restrict__ x, uint8_t* __restrict__ codes,
                   uint8_t* __restrict__ scales, NvParams p, int* flags) {
  constexpr int kCpb = Traits<DT>::kCpb, kWpb = Traits<DT>::kWpb;  // per 16 values
  const int64_t per_row = p.k / 32;
  const int64_t total = p.experts * p.rows * per_row;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= total) return;
  uint32_t w[2 * kWpb];
#pragma unroll
  for (int c = 0; c < 2 * kCpb; ++c) {
    const uint4 v = __ldg(x + g * (2 * kCpb) + c);
    w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
  }
  uint32_t bm = 0;
#pragma unroll
  for (int c = 0; c < 2 * kCpb; ++c)
    bm = fold_absmax<DT>(bm, make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]));
  bm = finish_absmax<DT>(bm);
  if (bm >= 0x7F800000u) {  // NaN/Inf in this block
    if (!p.nonfinite_saturate) {
      atomicOr(flags, NV_FLAG_NONFINITE);
      return;
    }
    sanitize_words<DT>(w);
    sanitize_words<DT>(w + kWpb);
    bm = 0;
#pragma unroll
    for (int c = 0; c < 2 * kCpb; ++c)
      bm = fold_absmax<DT>(bm, make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]));
    bm = finish_absmax<DT>(bm);
  }
  const uint32_t byte = nv_e8m0_byte(__uint_as_float(bm), p.op_order);
  const int64_t r = g / per_row, j = g % per_row;
  const int64_t at = p.swizzled
                         ? nv_swizzle_row_base(r / p.rows, r % p.rows, p.rows, per_row) + nv_swizzle_col(j)
                         : g;
  scales[at] = static_cast<uint8_t>(byte);
  const float mult = nv_mx_mult(byte, p.op_order);
  const float neg_above = nv_neg_threshold(p.signed_zero);
  // NV_ORDER_TORCHAO: encode8 multiplies (only the ModelOpt order divides)
  uint2 lo, hi;
  lo.x = encode8<DT, NV_ORDER_TORCHAO, SZ>(w, mult, 1.0f, false, neg_above);
  lo.y = encode8<DT, NV_ORDER_TORCHAO, SZ>(w + kWpb / 2, mult, 1.0f, false, neg_above);
  hi.x = encode8<DT, NV_ORDER_TORCHAO, SZ>(w + kWpb, mult, 1.0f, false, neg_above);
  hi.y = encode8<DT, NV_ORDER_TORCHAO, SZ>(w + kWpb + kWpb / 2, mult, 1.0f, false, neg_above);
  uint2* out = reinterpret_cast<uint2*>(codes) + 2 * g;  // 16 bytes per block
  __stcs(out, lo);
  __stcs(out + 1, hi);
}

template <int DT, int SZ>
cudaError_t launch_mx2(const void* x, uint8_t* codes, uint8_t* scales, const NvParams& p,
                       int* flags, cudaStream_t s) {
  const int64_t blocks = p.experts * p.rows * (p.k / 32);
  if (blocks == 0) return cudaSuccess;  // K = 0: nothing to write (an empty grid is an error)
  const dim3 grid(static_cast<unsigned>((blocks + 255) / 256));
  quantize_mx_blocks<DT, SZ><<<grid, 256, 0, s>>>(static_cast<const uint4*>(x), codes, scales,
                                                   p, flags);
  return cudaGetLastError();
}

template <int DT>
cudaError_t launch_mx1(const void* x, uint8_t* codes, uint8_t* scales, const NvParams& p,
                       int* flags, cudaStream_t s) {
  if (p.signed_zero == NV_SZ_POSITIVE)
    return launch_mx2<DT, SZ_FAST_POSITIVE>(x, codes, scales, p, flags, s);
  if (p.signed_zero == NV_SZ_SIGN_OF_INPUT)
    return launch_mx2<DT, SZ_FAST_INPUT>(x, codes, scales, p, flags, s);
  return launch_mx2<DT, SZ_GENERIC>(x, codes, scales, p, flags, s);
}

// The MXFP4 launch of nvfp4_quantize_cuda (an MX op_order); the outer-scale arguments of
// the NVFP4 kernels are not read.
cudaError_t launch_mx(const void* x, uint8_t* codes, uint8_t* scales, const NvParams& p,
                      int* flags, cudaStream_t s) {
  switch (p.in_dtype) {
    case NV_IN_BF16: return launch_mx1<NV_IN_BF16>(x, codes, scales, p, flags, s);
    case NV_IN_FP16: return launch_mx1<NV_IN_FP16>(x, codes, scales, p, flags, s);
    case NV_IN_FP32: return launch_mx1<NV_IN_FP32>(x, codes, scales, p, flags, s);
    default: return cudaErrorInvalidValue;
  }
}
