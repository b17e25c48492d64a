// The C ABI of libalign's compiled NVFP4 kernels: the one bindings surface.
//
// Python reaches these through ctypes (libalign/kernels/native.py); nothing here depends on
// Python or PyTorch headers, so a build is one compiler call and takes seconds.
// Every kernel reproduces libalign.spec.quantize bit for bit for the parameters below;
// anything else (compressed-tensors' bf16 scale math, Hadamard rotation, stochastic
// rounding, K not a multiple of the block) stays with the spec. 4-over-6 block scaling and
// the E4M3 bound 256 (the te order only) are served: e4m3_max and four_over_six below.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { NV_IN_BF16 = 0, NV_IN_FP16 = 1, NV_IN_FP32 = 2 };
enum { NV_ORDER_TE = 0, NV_ORDER_TORCHAO = 1, NV_ORDER_MODELOPT = 2 };
// MXFP4 (E8M0 scale per 32 values, no outer scale): the op_order names the E8M0 rule
// (libalign/spec/scale_math.py: mx_floor, mx_ceil, mx_even, mx_te). With these the kernels read
// no outer scale (outer_mode GIVEN, enc/dec unused), k must be a multiple of 32, and scales
// receives one E8M0 byte per 32 values (experts*rows*k/32, or the swizzled size of k/32
// columns). The NVFP4 scale policies (floors, zero substitution) do not apply.
enum { NV_ORDER_MX_FLOOR = 3, NV_ORDER_MX_CEIL = 4, NV_ORDER_MX_EVEN = 5, NV_ORDER_MX_TE = 6 };
#define NV_IS_MX(order) ((order) >= NV_ORDER_MX_FLOOR && (order) <= NV_ORDER_MX_TE)
enum { NV_OUTER_GIVEN = 0, NV_OUTER_ROW = 1 };
enum { NV_STORE_AMAX = 0, NV_STORE_ENC = 1, NV_STORE_DEC = 2 };
enum { NV_SZ_POSITIVE = 0, NV_SZ_SIGN_OF_INPUT = 1, NV_SZ_SIGN_OF_NONZERO = 2 };
// 4-over-6 block scaling (libalign/spec/four_over_six.py), by whose order the 16 errors of a
// block are summed: TE's (one after another) or FlashInfer's (two halves of 8, then added;
// an all-zero block stores codes 0). Defined for the te order with zero_saturate only.
enum { NV_FOS_OFF = 0, NV_FOS_TE = 1, NV_FOS_FLASHINFER = 2 };
enum { NV_FOS_MAE = 0, NV_FOS_MSE = 1 };

// Flags returned by the kernels (OR-ed): the caller re-runs the spec, which raises the
// precise typed error (positions of NaN/Inf, or the undefined-scale explanation).
enum { NV_FLAG_NONFINITE = 1, NV_FLAG_UNDEFINED_SCALE = 2, NV_FLAG_USE_SPEC = 4 };
// NV_FLAG_USE_SPEC: a block whose exact result the fast path does not reproduce (a
// ModelOpt-order divisor s * dec that underflows to zero, where the spec divides 0 by 0);
// the caller returns the spec's result for the whole call instead.

typedef struct NvParams {
  int64_t experts;      // leading dimension of a 3-D stack (1 for a matrix)
  int64_t rows;         // rows per expert (M)
  int64_t k;            // row length, a multiple of 16 (MXFP4: of 32)
  int32_t in_dtype;     // NV_IN_*
  int32_t op_order;     // NV_ORDER_*
  int32_t outer_mode;   // NV_OUTER_GIVEN: enc/dec arrays; NV_OUTER_ROW: from each row's amax
  int32_t outer_stride; // GIVEN mode: 0 = one enc/dec for all, 1 = one per expert
  int32_t store_conv;   // ROW mode: what stored_out holds (NV_STORE_*)
  int32_t has_amax_floor;
  float amax_floor;
  float block_scale_floor;  // lower clamp of the fp32 block scale (0 when none)
  int32_t has_zero_prescale;
  float zero_prescale_to;   // substitute for an fp32 block scale of exactly zero
  int32_t zero_saturate;    // a zero E4M3 scale encodes with FLT_MAX (1) or 0 (0)
  int32_t signed_zero;      // NV_SZ_*
  int32_t nonfinite_saturate; // NaN -> 0, +-Inf -> +-in_max instead of flagging
  float in_max;             // largest finite value of the input dtype
  int32_t swizzled;         // block scales in the 128x4 layout (caller zero-fills)
  float e4m3_max;           // the E4M3 bound of the outer scale: 448, or 256 (te order:
                            // enc = fl(6 * e4m3_max / amax))
  int32_t four_over_six;    // NV_FOS_*; with it, GIVEN mode reads the outer maxima (one per
                            // enc/dec entry) from amax_out, which every block's error needs
  int32_t four_over_six_error;  // NV_FOS_MAE or NV_FOS_MSE
  const void* const* gather;    // NULL, or p->experts pointers (host memory for the CPU
                                // call, device memory for the CUDA one): expert e's rows*k
                                // contiguous elements are read from gather[e] instead of
                                // x + e*rows*k; the outputs are laid out as for one stack.
                                // NVFP4 ROW mode, unswizzled scales only (else -3).
} NvParams;

// CPU: x points at experts*rows*k elements of in_dtype (contiguous). codes receives
// experts*rows*k/2 bytes, scales experts*rows*k/16 bytes (or the swizzled size).
// ROW mode writes amax_out/stored_out (experts*rows floats each); GIVEN mode reads
// enc/dec (and, under four_over_six, the outer maxima from amax_out). Returns the OR of
// NV_FLAG_* (0 on success).
int nvfp4_quantize_cpu(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                       float* stored_out, const float* enc, const float* dec,
                       const NvParams* p, int nthreads);

// CPU: per-expert max |x| (experts floats) for the tensor/expert domains; NaN/Inf set the
// flag (or are saturated first, as nonfinite_saturate says).
int nvfp4_amax_cpu(const void* x, float* amax_out, const NvParams* p, int nthreads);

// CPU instruction-set paths, all compiled into the one library and chosen at run time.
enum { NV_CPU_SCALAR = 0, NV_CPU_AVX2 = 1, NV_CPU_AVX512 = 2 };
// CPU: the paths this CPU can run (bit 1 << NV_CPU_*), the path serving calls now (the
// best supported unless one was set), and set_path: force one (-1: back to the best);
// returns 0, or -1 for a path this CPU lacks (nothing changes). The tests run every
// supported path against the spec.
int nvfp4_cpu_supported_paths(void);
int nvfp4_cpu_path(void);
int nvfp4_cpu_set_path(int path);

// CUDA: the same contract on device pointers, asynchronously on `stream`; flags_dev is
// one device int the kernels OR their flags into (the caller zeroes and reads it).
int nvfp4_quantize_cuda(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                        float* stored_out, const float* enc, const float* dec,
                        const NvParams* p, int* flags_dev, void* stream);
int nvfp4_amax_cuda(const void* x, float* amax_out, const NvParams* p, int* flags_dev,
                    void* stream);
// CUDA: which quantize kernel serves a shape: 0 picks per shape (the register-resident
// kernel where a row fits its lanes' registers, else the shared-memory one), 1 always the
// shared-memory kernel, 2 the register kernel wherever it fits. Returns 0, or -1 for an
// unknown variant. For the tests and the benchmark, which check and time both.
int nvfp4_cuda_set_variant(int variant);

#ifdef __cplusplus
}
#endif
