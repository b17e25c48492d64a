// Probe of the built CPU kernel library (tests/libalign/test_native_build.py): prints the
// instruction-set paths this CPU supports and checks that every supported SIMD path gives
// the scalar path's bits (codes, scale bytes, outer scales, flags, expert maxima) over
// bf16/fp16/fp32 inputs with E2M1 ties, tiny blocks and signed zeros, the three operation
// orders, the three signed-zero policies, row and given outer scales, linear and swizzled
// scales. The scalar path itself is pinned to the spec by test_ops_kernels.py. Run natively
// and under an emulated CPU without AVX-512 (qemu-x86_64 -cpu Haswell) or AVX
// (-cpu Nehalem): it shows that the one library picks, and runs, the right path there.
// Exit status 0 when all agree; the last line says how many comparisons were made.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "nvfp4_abi.h"

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

static uint16_t to_fp16_bits(float f) {  // exact for the grid values used; else truncated
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);  // underflow to a signed zero
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7BFFu);  // largest finite
  return static_cast<uint16_t>(sign | (exp << 10) | ((u >> 13) & 0x3FFu));
}

int main() {
  const int mask = nvfp4_cpu_supported_paths();
  printf("paths %d best %d\n", mask, nvfp4_cpu_path());
  std::mt19937 g(7);
  std::normal_distribution<float> normal;
  const float grid[] = {0, 0.25f, 0.5f, 0.75f, 1, 1.25f, 1.5f, 1.75f, 2, 2.5f, 3, 3.5f, 4, 5, 6};
  int compared = 0, differ = 0;
  const int64_t E = 2, M = 37, K = 272, n = E * M * K;
  const int64_t nb = K / 16, rp = (M + 127) / 128 * 128, cp = (nb + 3) / 4 * 4;
  for (int dtype = 0; dtype < 3; ++dtype)
    for (int order = 0; order < 3; ++order)
      for (int sz = 0; sz < 3; ++sz)
        for (int row_mode = 0; row_mode < 2; ++row_mode)
          for (int swizzled = 0; swizzled < 2; ++swizzled) {
            std::vector<float> xf(static_cast<size_t>(n));
            for (auto& v : xf) {
              const unsigned kind = g() % 4;
              const float sign = (g() & 1) ? -1.0f : 1.0f;
              v = kind == 0   ? normal(g)
                  : kind == 1 ? sign * grid[g() % 15] * static_cast<float>(1 << (g() % 8)) / 16.0f
                  : kind == 2 ? normal(g) * 1e-6f
                              : sign * 0.0f;
            }
            std::vector<uint16_t> x16(static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) x16[i] = dtype == NV_IN_BF16 ? to_bf16(xf[i]) : to_fp16_bits(xf[i]);
            const void* x = dtype == NV_IN_FP32 ? static_cast<const void*>(xf.data()) : x16.data();
            NvParams p{};
            p.experts = E; p.rows = M; p.k = K; p.in_dtype = dtype; p.op_order = order;
            p.outer_mode = row_mode ? NV_OUTER_ROW : NV_OUTER_GIVEN; p.outer_stride = 1;
            p.store_conv = NV_STORE_DEC; p.has_amax_floor = 1; p.amax_floor = 1e-12f;
            p.block_scale_floor = order == NV_ORDER_TE ? 0.0f : 1.0f / 512;
            p.has_zero_prescale = order == NV_ORDER_TE; p.zero_prescale_to = 1.0f;
            p.zero_saturate = order == NV_ORDER_TE; p.signed_zero = sz; p.in_max = 3e38f;
            p.swizzled = swizzled; p.e4m3_max = 448.0f;
            std::vector<float> enc(E, 0.37f), dec(E, 1 / 0.37f);
            std::vector<uint8_t> ref_c(static_cast<size_t>(n / 2)), ref_s(static_cast<size_t>(E * rp * cp));
            std::vector<float> ref_a(E * M), ref_o(E * M), ref_m(E);
            nvfp4_cpu_set_path(NV_CPU_SCALAR);
            const int ref_f = nvfp4_quantize_cpu(x, ref_c.data(), ref_s.data(), ref_a.data(), ref_o.data(),
                                                 enc.data(), dec.data(), &p, 2);
            const int ref_mf = nvfp4_amax_cpu(x, ref_m.data(), &p, 2);
            for (int path = NV_CPU_AVX2; path <= NV_CPU_AVX512; ++path) {
              if (!((mask >> path) & 1)) continue;
              nvfp4_cpu_set_path(path);
              std::vector<uint8_t> c(ref_c.size()), s(ref_s.size());
              std::vector<float> a(ref_a.size()), o(ref_o.size()), m(ref_m.size());
              const int f = nvfp4_quantize_cpu(x, c.data(), s.data(), a.data(), o.data(), enc.data(),
                                               dec.data(), &p, 2);
              const int mf = nvfp4_amax_cpu(x, m.data(), &p, 2);
              ++compared;
              const bool same = f == ref_f && mf == ref_mf && (ref_f || (c == ref_c && s == ref_s)) &&
                                memcmp(a.data(), ref_a.data(), a.size() * 4) == 0 &&
                                memcmp(o.data(), ref_o.data(), o.size() * 4) == 0 &&
                                memcmp(m.data(), ref_m.data(), m.size() * 4) == 0;
              if (!same) {
                ++differ;
                printf("DIFF path %d dtype %d order %d signed_zero %d row %d swizzled %d\n", path, dtype,
                       order, sz, row_mode, swizzled);
              }
            }
          }
  nvfp4_cpu_set_path(-1);
  printf("compared %d differ %d\n", compared, differ);
  return differ != 0;
}
