// Native Blackwell (sm_100a) grouped NVFP4 GEMM through CUTLASS's block-scaled kernels.
// Matches: libalign.gemm (the three-step W4A4 product) for step 3 exactly; step 2's fp32
// additions are summed in the tensor core's own order. ABI and layouts: gemm_abi.h.
//
// STATUS: compiled for sm_100a in this project's tests; never run (no Blackwell device).
//
// How one call works
//   1. fill_group_arguments (one thread per expert, any arch) turns row_offsets into the
//      per-expert arrays CUTLASS's grouped ("ptr-array") kernels read from device memory:
//      problem shapes {M_e, N, K}, operand and scale pointers, strides and scale layouts,
//      and one pointer per expert into a_dec and w_dec. Nothing about M_e ever reaches the
//      host, so the call needs no device synchronisation (and can be graph-captured).
//   2. The CUTLASS kernel (KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100: one SM per
//      128x128 output tile, 256-deep K steps, TMA descriptors rewritten per expert on
//      the device) multiplies E2M1 codes with their E4M3 block scales in the tensor core
//      (tcgen05 kind::mxf4nvf4, scale vector 16) and accumulates in fp32.
//   3. The epilogue is an EVT tree, not CUTLASS's alpha/beta linear combination:
//          out = bf16_rn( acc * (a_dec[row] * w_dec[col]) )
//      a column-vector broadcast of a_dec (one value per output row; a stride flag of 0
//      turns it into one scalar), a row-vector broadcast of w_dec (one per output
//      column, or one per expert), their fp32 product, one fp32 multiply of the
//      accumulator, one round-to-nearest-even conversion. Both broadcasts take a pointer
//      per expert, which is how variable-length groups get their own slice of a_dec.
//      No addition is involved, so no contraction can change the order.
//
// Architecture guard
//   The CUTLASS types need CUDA >= 12.8 (CUTLASS_ARCH_MMA_SM100_SUPPORTED); without it (or
//   with -DALIGN_GEMM_SM100_STUB) the file compiles to stubs answering NV_GEMM_ERR_ARCH.
//   In device passes for any arch other than sm_100a/sm_100f the kernel body compiles to
//   nothing (Sm100Only below), and at run time the entry points refuse devices other
//   than CC 10.0 and libraries holding no image for the current device.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gemm_abi.h"
#include "cutlass/arch/config.h"
#include "cutlass/cutlass.h"

#if defined(CUTLASS_ARCH_MMA_SM100_SUPPORTED) && !defined(ALIGN_GEMM_SM100_STUB)
#define ALIGN_GEMM_SM100_BUILT 1
#endif

#if defined(ALIGN_GEMM_SM100_BUILT)
#include <mutex>

#include "cute/tensor.hpp"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

// A named namespace: an anonymous one collides with cute's in nvcc's generated stubs.
namespace align_sm100 {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

// ---- the kernel's types ---------------------------------------------------------------
using Fp4 = cutlass::nv_float4_t<cutlass::float_e2m1_t>;  // E2M1 data + E4M3 scale per 16
using OutT = cutlass::bfloat16_t;
using TileMNK = Shape<_128, _128, _256>;
using ClusterMNK = Shape<_1, _1, _1>;
using Problem = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // {M_e, N, K}
constexpr auto kRne = cutlass::FloatRoundStyle::round_to_nearest;

// a_dec: one value per output row (a column vector), one pointer per expert; stride flag
// false = every row reads element 0 (one scalar). Alignment 1: a_dec + row_offsets[e] is
// only 4-byte aligned.
using ADecBroadcast =
    fusion::Sm90ColBroadcast<0, TileMNK, float*, float, Stride<bool, _0, _0>, 1>;
// w_dec: one value per output column (a row vector), one pointer per expert; stride flag
// false = one value for the whole expert.
using WDecBroadcast =
    fusion::Sm90RowBroadcast<0, TileMNK, float*, float, Stride<_0, bool, _0>, 1>;
using DecProduct =                                                       // fl(a_dec * w_dec)
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRne>,
                    ADecBroadcast, WDecBroadcast>;
using ScaledOutput =                                                     // bf16(fl(acc * dec))
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, OutT, float, kRne>,
                    fusion::Sm90AccFetch, DecProduct>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, TileMNK, ClusterMNK,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor*, 8,  // no C operand
    OutT, cutlass::layout::RowMajor*, 8,
    cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm, ScaledOutput>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp,
    Fp4, cutlass::layout::RowMajor*, 32,     // A [M_e, K], K contiguous
    Fp4, cutlass::layout::ColumnMajor*, 32,  // B^T: weights [N, K], K contiguous
    float, TileMNK, ClusterMNK,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;

// The CUTLASS kernel with its body compiled only in sm_100a/sm_100f device passes, so a
// multi-arch build (or a pass for another arch) produces an empty kernel, not an error.
template <class K>
struct Sm100Only : K {
  template <class... Args>
  CUTLASS_DEVICE void operator()(Args&&... args) {
#if defined(CUTLASS_ARCH_MMA_SM100A_ENABLED) || defined(CUTLASS_ARCH_MMA_SM100F_ENABLED)
    K::operator()(static_cast<Args&&>(args)...);
#endif
  }
};

using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Sm100Only<Kernel>>;

using ElemA = typename Mainloop::ArrayElementA;
using ElemB = typename Mainloop::ArrayElementB;
using ElemSF = typename Mainloop::ElementSF;
using StrideA = typename Mainloop::InternalStrideA;
using StrideB = typename Mainloop::InternalStrideB;
using LayoutSFA = typename Mainloop::InternalLayoutSFA;
using LayoutSFB = typename Mainloop::InternalLayoutSFB;
using ScaleConfig = typename Mainloop::Sm1xxBlkScaledConfig;
using ElemD = typename Epilogue::ElementD;
using StrideD = typename Epilogue::InternalStrideD;
using Shape3 = typename Problem::UnderlyingProblemShape;

// ---- per-expert argument arrays, carved from the caller's workspace ----------------------
struct GroupArrays {
  Shape3* shapes;
  const ElemA** a;
  const ElemB** b;
  const ElemSF** sfa;
  const ElemSF** sfb;
  ElemD** d;
  const float** a_dec;
  const float** w_dec;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
};

constexpr size_t kAlign = 256;
constexpr size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Byte offsets of each array for E experts; returns the total (a multiple of kAlign).
static size_t carve(GroupArrays* g, char* base, int experts) {
  size_t at = 0;
  auto take = [&](auto*& field, size_t elem_bytes) {
    using P = std::remove_reference_t<decltype(field)>;
    field = base ? reinterpret_cast<P>(base + at) : nullptr;
    at += round_up(elem_bytes * static_cast<size_t>(experts), kAlign);
  };
  take(g->shapes, sizeof(Shape3));
  take(g->a, sizeof(void*));
  take(g->b, sizeof(void*));
  take(g->sfa, sizeof(void*));
  take(g->sfb, sizeof(void*));
  take(g->d, sizeof(void*));
  take(g->a_dec, sizeof(void*));
  take(g->w_dec, sizeof(void*));
  take(g->stride_a, sizeof(StrideA));
  take(g->stride_b, sizeof(StrideB));
  take(g->stride_d, sizeof(StrideD));
  take(g->layout_sfa, sizeof(LayoutSFA));
  take(g->layout_sfb, sizeof(LayoutSFB));
  return at;
}

__host__ __device__ inline int64_t pad128(int64_t rows) { return (rows + 127) / 128 * 128; }

// Thread e writes expert e's entries. The scale offset of expert e sums the padded row
// counts of the experts before it: O(E) per thread, trivial for any real expert count.
__global__ void fill_group_arguments(NvGemmSm100Args p, GroupArrays g) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.experts) return;
  const int64_t n = p.n, k = p.k;
  const int64_t sf_cols = (k / 16 + 3) / 4 * 4;  // scale columns padded to the 4-wide tile
  const int64_t r0 = p.row_offsets[e];
  const int64_t r1 = p.row_offsets[e + 1];
  const int64_t m = r1 > r0 ? r1 - r0 : 0;  // a decreasing pair reads as an empty expert
  int64_t sf_rows_before = 0;
  for (int j = 0; j < e; ++j) {
    const int64_t rows = static_cast<int64_t>(p.row_offsets[j + 1]) - p.row_offsets[j];
    sf_rows_before += rows > 0 ? pad128(rows) : 0;
  }
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);

  g.shapes[e] = Shape3(mi, ni, ki);
  g.a[e] = reinterpret_cast<const ElemA*>(p.a_codes + r0 * (k / 2));
  g.b[e] = reinterpret_cast<const ElemB*>(p.w_codes + e * n * (k / 2));
  g.sfa[e] = reinterpret_cast<const ElemSF*>(p.a_scales + sf_rows_before * sf_cols);
  g.sfb[e] = reinterpret_cast<const ElemSF*>(p.w_scales + e * pad128(n) * sf_cols);
  g.d[e] = reinterpret_cast<ElemD*>(static_cast<uint16_t*>(p.out) + r0 * n);
  g.a_dec[e] = p.a_dec + (p.a_dec_per_row ? r0 : 0);
  g.w_dec[e] = p.w_dec + (p.w_dec_mode == NV_GEMM_WDEC_PER_ROW      ? e * n
                          : p.w_dec_mode == NV_GEMM_WDEC_PER_EXPERT ? e
                                                                    : 0);
  g.stride_a[e] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(mi, ki, 1));
  g.stride_b[e] = cutlass::make_cute_packed_stride(StrideB{}, make_shape(ni, ki, 1));
  g.stride_d[e] = cutlass::make_cute_packed_stride(StrideD{}, make_shape(mi, ni, 1));
  g.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(mi, ni, ki, 1));
  g.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(mi, ni, ki, 1));
}

// ---- host helpers ----------------------------------------------------------------------
static int check_shape(const NvGemmSm100Args* p) {
  if (p == nullptr || p->experts < 1 || p->n < 8 || p->k < 32) return NV_GEMM_ERR_SHAPE;
  if (p->k % 32 || p->n % 8) return NV_GEMM_ERR_SHAPE;  // 16-byte TMA rows of A/B and D
  if (p->w_dec_mode < NV_GEMM_WDEC_SCALAR || p->w_dec_mode > NV_GEMM_WDEC_PER_ROW) {
    return NV_GEMM_ERR_SHAPE;
  }
  if (static_cast<int64_t>(p->experts) * p->n * (p->k / 2) >= (int64_t(1) << 62)) {
    return NV_GEMM_ERR_SHAPE;
  }
  return NV_GEMM_OK;
}

static int check_pointers(const NvGemmSm100Args* p) {
  if (!p->row_offsets || !p->a_codes || !p->a_scales || !p->a_dec || !p->w_codes ||
      !p->w_scales || !p->w_dec || !p->out) {
    return NV_GEMM_ERR_SHAPE;
  }
  return NV_GEMM_OK;
}

// SM count of the current device (cached per device: the query is not free).
static int sm_count(int device) {
  static std::mutex lock;
  static int cached[64] = {0};
  if (device < 0 || device >= 64) {
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }
  std::lock_guard<std::mutex> guard(lock);
  if (cached[device] == 0) {
    cached[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }
  return cached[device];
}

// 1 when the current device is CC 10.0 and this library holds images it can run.
static int device_ok() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (major != 10 || minor != 0) return 0;  // sm_100a images run on CC 10.0 only
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, cutlass::device_kernel<Sm100Only<Kernel>>) != cudaSuccess ||
      cudaFuncGetAttributes(&attr, fill_group_arguments) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return 1;
}

static typename Gemm::Arguments make_arguments(const NvGemmSm100Args* p, const GroupArrays& g,
                                               int device) {
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {p->experts, g.shapes, nullptr};  // shapes live on the device only
  args.mainloop.ptr_A = g.a;
  args.mainloop.dA = g.stride_a;
  args.mainloop.ptr_B = g.b;
  args.mainloop.dB = g.stride_b;
  args.mainloop.ptr_SFA = g.sfa;
  args.mainloop.layout_SFA = g.layout_sfa;
  args.mainloop.ptr_SFB = g.sfb;
  args.mainloop.layout_SFB = g.layout_sfb;

  // EVT arguments nest as the tree does: op_0.. are the children, the last one the node.
  auto& product = args.epilogue.thread.op_1;  // op_0: the accumulator
  auto& a_dec = product.op_0;
  auto& w_dec = product.op_1;
  a_dec.ptr_col = g.a_dec;
  a_dec.dCol = {bool(p->a_dec_per_row), _0{}, _0{}};
  w_dec.ptr_row = g.w_dec;
  w_dec.dRow = {_0{}, bool(p->w_dec_mode == NV_GEMM_WDEC_PER_ROW), _0{}};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = g.d;
  args.epilogue.dD = g.stride_d;

  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count(device);
  return args;
}

static int workspace_bytes(const NvGemmSm100Args* p, int device, size_t* bytes) {
  GroupArrays g{};
  const size_t arrays = carve(&g, nullptr, p->experts);
  typename Gemm::Arguments args = make_arguments(p, g, device);
  *bytes = arrays + round_up(Gemm::get_workspace_size(args), kAlign);
  return NV_GEMM_OK;
}

}  // namespace align_sm100

using namespace align_sm100;

extern "C" {

int nvfp4_gemm_sm100_available(void) { return device_ok(); }

int nvfp4_gemm_sm100_workspace_size(const NvGemmSm100Args* args, size_t* bytes) {
  if (bytes == nullptr) return NV_GEMM_ERR_WORKSPACE;
  *bytes = 0;
  if (int s = check_shape(args)) return s;
  if (!device_ok()) return NV_GEMM_ERR_ARCH;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return NV_GEMM_ERR_CUDA;
  return workspace_bytes(args, dev, bytes);
}

int nvfp4_grouped_gemm_sm100(const NvGemmSm100Args* p, void* workspace, size_t ws_bytes,
                             void* stream) {
  if (int s = check_shape(p)) return s;
  if (int s = check_pointers(p)) return s;
  if (!device_ok()) return NV_GEMM_ERR_ARCH;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return NV_GEMM_ERR_CUDA;
  size_t need = 0;
  workspace_bytes(p, dev, &need);
  if (workspace == nullptr || ws_bytes < need ||
      reinterpret_cast<uintptr_t>(workspace) % kAlign) {
    return NV_GEMM_ERR_WORKSPACE;
  }
  auto st = static_cast<cudaStream_t>(stream);

  GroupArrays g{};
  char* base = static_cast<char*>(workspace);
  const size_t arrays = carve(&g, base, p->experts);
  const int threads = 128;
  fill_group_arguments<<<(p->experts + threads - 1) / threads, threads, 0, st>>>(*p, g);
  if (cudaGetLastError() != cudaSuccess) return NV_GEMM_ERR_CUDA;

  typename Gemm::Arguments args = make_arguments(p, g, dev);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return NV_GEMM_ERR_CAN_IMPLEMENT;
  if (gemm.initialize(args, base + arrays, st) != cutlass::Status::kSuccess) {
    cudaGetLastError();
    return NV_GEMM_ERR_CUDA;
  }
  if (gemm.run(st) != cutlass::Status::kSuccess) {
    cudaGetLastError();
    return NV_GEMM_ERR_CUDA;
  }
  return NV_GEMM_OK;
}

}  // extern "C"

#else  // no SM100 support in this toolkit (or a stub build): every call says so

extern "C" {

int nvfp4_gemm_sm100_available(void) { return 0; }

int nvfp4_gemm_sm100_workspace_size(const NvGemmSm100Args*, size_t* bytes) {
  if (bytes) *bytes = 0;
  return NV_GEMM_ERR_ARCH;
}

int nvfp4_grouped_gemm_sm100(const NvGemmSm100Args*, void*, size_t, void*) {
  return NV_GEMM_ERR_ARCH;
}

}  // extern "C"

#endif

extern "C" const char* nvfp4_gemm_sm100_status_string(int status) {
  switch (status) {
    case NV_GEMM_OK: return "ok";
    case NV_GEMM_ERR_ARCH:
      return "unsupported architecture: the library holds no sm_100a kernel or the current "
             "device is not compute capability 10.0";
    case NV_GEMM_ERR_SHAPE:
      return "bad shape or argument: E >= 1, K a multiple of 32, N a multiple of 8, "
             "a known w_dec mode and non-null pointers are required";
    case NV_GEMM_ERR_CAN_IMPLEMENT: return "CUTLASS can_implement refused the problem";
    case NV_GEMM_ERR_WORKSPACE: return "workspace missing, too small or not 256-byte aligned";
    case NV_GEMM_ERR_CUDA: return "a CUDA call or CUTLASS initialize/run failed";
    default: return "unknown status";
  }
}

extern "C" size_t nvfp4_gemm_sm100_args_size(void) { return sizeof(NvGemmSm100Args); }
