// The C ABI of libalign's native Blackwell grouped NVFP4 GEMM (csrc/gemm_nvfp4_sm100.cu).
//
// Like nvfp4_abi.h, a plain C surface reached through ctypes (libalign/kernels/native.py, build
// kind "gemm_sm100"); the CUTLASS headers are needed to build it, not to call it.
//
// What it computes, for each expert e of E (libalign.gemm's three steps):
//   rows r in [row_offsets[e], row_offsets[e+1]) of the token-permuted activations,
//   acc[r, n] = sum_k (q_a[r,k] * s_a[r,k/16]) * (q_w[e,n,k] * s_w[e,n,k/16])   (fp32, tensor core)
//   out[r, n] = bf16_rn( acc[r, n] * (a_dec[r] * w_dec[e, n]) )                   (fp32 epilogue)
// The epilogue is an EVT tree (per-row and per-column broadcasts, one fp32 product of the
// two decode scales, one fp32 multiply of the accumulator, one round-to-nearest-even to
// bf16), so its order is exactly the spec's; the accumulation order is the tensor core's.
//
// Operand layouts (all device memory, all contiguous):
//   a_codes   uint8 [M_total, K/2]  E2M1 codes, even k in the low nibble, rows sorted by
//                                   expert as row_offsets says (an expert may have 0 rows)
//   a_scales  E4M3 bytes, per expert the 128x4-swizzled layout of its [M_e, K/16] scale
//             matrix (libalign.packing), padded to ceil(M_e/128)*128 rows and
//             ceil(K/64)*4 columns; the experts' buffers follow each other, so expert e's
//             starts at byte  sum_{j<e} ceil(M_j/128)*128 * ceil(K/64)*4
//             (at most (M_total + 127*E) * ceil(K/64)*4 bytes in all)
//   a_dec     fp32, [M_total] (a_dec_per_row = 1) or one value (a_dec_per_row = 0)
//   w_codes   uint8 [E, N, K/2]
//   w_scales  E4M3 bytes, E consecutive swizzled [N, K/16] matrices (ceil(N/128)*128 *
//             ceil(K/64)*4 bytes each): the layout of a 3-D GemmOperand
//   w_dec     fp32, [E, N] (NV_GEMM_WDEC_PER_ROW), [E] (PER_EXPERT) or one value (SCALAR)
//   out       bf16 [M_total, N]
// Shapes: K a multiple of 32 (16-byte TMA rows of FP4), N a multiple of 8 (16-byte bf16 rows).
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Status codes (0 = success).
enum {
  NV_GEMM_OK = 0,
  NV_GEMM_ERR_ARCH = 1,           // not built for sm_100a, or the current device is not CC 10.0
  NV_GEMM_ERR_SHAPE = 2,          // E, N or K out of range / misaligned, a null pointer
  NV_GEMM_ERR_CAN_IMPLEMENT = 3,  // CUTLASS's can_implement refused the arguments
  NV_GEMM_ERR_WORKSPACE = 4,      // workspace missing, too small or misaligned
  NV_GEMM_ERR_CUDA = 5,           // a CUDA call or CUTLASS initialize/run failed
};

enum { NV_GEMM_WDEC_SCALAR = 0, NV_GEMM_WDEC_PER_EXPERT = 1, NV_GEMM_WDEC_PER_ROW = 2 };

typedef struct NvGemmSm100Args {
  int32_t experts;        // E >= 1
  int32_t n;              // output columns (weight rows per expert)
  int32_t k;              // contraction length
  int32_t a_dec_per_row;  // 1: a_dec[r] per activation row, 0: a_dec[0] for all rows
  int32_t w_dec_mode;     // NV_GEMM_WDEC_*
  int32_t reserved;       // 0
  const int32_t* row_offsets;  // device int32 [E+1]: 0, then non-decreasing; last = M_total
  const uint8_t* a_codes;
  const uint8_t* a_scales;
  const float* a_dec;
  const uint8_t* w_codes;
  const uint8_t* w_scales;
  const float* w_dec;
  void* out;              // bf16
} NvGemmSm100Args;

// 1 when this library holds the sm_100a kernel and the current device can run it, else 0.
int nvfp4_gemm_sm100_available(void);

// Device workspace bytes the call needs (per-expert argument arrays and CUTLASS's own).
int nvfp4_gemm_sm100_workspace_size(const NvGemmSm100Args* args, size_t* bytes);

// Launch asynchronously on `stream` (a cudaStream_t; NULL = legacy default stream).
// The workspace (256-byte aligned, at least workspace_size bytes) must not be reused
// before the GEMM has finished on that stream.
int nvfp4_grouped_gemm_sm100(const NvGemmSm100Args* args, void* workspace,
                             size_t workspace_bytes, void* stream);

// A static description of a status code.
const char* nvfp4_gemm_sm100_status_string(int status);

// sizeof(NvGemmSm100Args), so a binding can check its mirror of the struct.
size_t nvfp4_gemm_sm100_args_size(void);

#ifdef __cplusplus
}
#endif
