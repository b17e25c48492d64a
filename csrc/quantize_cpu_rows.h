// The row driver of the CPU kernel, stamped once per instruction-set path.
//
// Not a standalone header: quantize_cpu.cpp includes it inside each path's namespace
// (nv_scalar, nv_avx2, nv_avx512) after that namespace has defined, for its instruction
// set,
//   float load_row(x, base, k, dtype, p, buf, vmax, flags)   widen a row, block maxima
//   void scale_blocks(vmax, nb, o, te_mult, p, sbytes, mult, div, undefined)
//   void encode_block(xb, enc, signed_zero, out)              16 values -> 8 bytes
//   float row_max16(x, base, k, dtype)                        16-bit row max, -1 if unknown
// and, for the SIMD paths, inside that path's `#pragma GCC target` region: every copy of
// the driver is compiled for its own target and inlines its own helpers. The shared,
// target-neutral steps (row_outer, store_scales) come from quantize_cpu.cpp.

// Encode one row's blocks; the signed-zero policy and whether the order divides (ModelOpt)
// are template arguments, so the block loop carries no per-block policy branches.
template <int SignedZero, bool Divides>
void encode_row(const float* buf, const float* mults, const float* divs, const uint8_t* sbytes,
                int64_t nb, uint8_t* crow) {
  for (int64_t b = 0; b < nb; ++b) {
    NvEnc enc_b;
    enc_b.mult = mults[b];
    enc_b.div = divs[b];
    enc_b.use_div = Divides && sbytes[b] != 0;  // a zero scale encodes by multiplying
    encode_block(buf + b * 16, enc_b, SignedZero, crow + b * 8);
  }
}

// Quantize rows [r0, r1) of the flattened experts*rows matrix; flags OR-ed into *flags.
void quantize_rows(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                   float* stored_out, const float* enc, const float* dec, const NvParams& p,
                   int64_t r0, int64_t r1, int* flags) {
  const int64_t k = p.k, nb = k / 16, nbp = (nb + 15) / 16 * 16;  // padded for 16-wide steps
  std::vector<float> buf(static_cast<size_t>(k)), vmax(static_cast<size_t>(nbp));
  std::vector<float> mults(static_cast<size_t>(nbp)), divs(static_cast<size_t>(nbp));
  std::vector<uint8_t> sbytes(static_cast<size_t>(nbp));
  int local = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t e = r / p.rows, rr = r % p.rows;
    const float rowmax = load_row(x, r * k, k, p.in_dtype, p, buf.data(), vmax.data(), &local);
    if (local & NV_FLAG_NONFINITE) break;
    const NvOuter o = row_outer(rowmax, p, r, e, enc, dec, amax_out, stored_out);
    int undefined = 0;
    scale_blocks(vmax.data(), nb, o, nv_te_block_mult(o.enc), p, sbytes.data(), mults.data(),
                 divs.data(), &undefined);
    if (undefined) local |= NV_FLAG_UNDEFINED_SCALE;
    store_scales(sbytes.data(), scales, p, r, e, rr, nb);
    uint8_t* crow = codes + r * (k / 2);
    const int sz = p.signed_zero;
    if (p.op_order == NV_ORDER_MODELOPT) {
      if (sz == NV_SZ_POSITIVE) encode_row<NV_SZ_POSITIVE, true>(buf.data(), mults.data(), divs.data(), sbytes.data(), nb, crow);
      else if (sz == NV_SZ_SIGN_OF_INPUT) encode_row<NV_SZ_SIGN_OF_INPUT, true>(buf.data(), mults.data(), divs.data(), sbytes.data(), nb, crow);
      else encode_row<NV_SZ_SIGN_OF_NONZERO, true>(buf.data(), mults.data(), divs.data(), sbytes.data(), nb, crow);
    } else {
      if (sz == NV_SZ_POSITIVE) encode_row<NV_SZ_POSITIVE, false>(buf.data(), mults.data(), divs.data(), sbytes.data(), nb, crow);
      else if (sz == NV_SZ_SIGN_OF_INPUT) encode_row<NV_SZ_SIGN_OF_INPUT, false>(buf.data(), mults.data(), divs.data(), sbytes.data(), nb, crow);
      else encode_row<NV_SZ_SIGN_OF_NONZERO, false>(buf.data(), mults.data(), divs.data(), sbytes.data(), nb, crow);
    }
  }
  *flags |= local;
}

// Row maxima of rows [r0, r1), folded into part[expert] (the tensor/expert domains' pass).
void amax_rows(const void* x, const NvParams& p, int64_t r0, int64_t r1, float* part,
               int* flags) {
  const int64_t k = p.k, nb = k / 16;
  std::vector<float> buf(static_cast<size_t>(k)), vmax(static_cast<size_t>(nb));
  for (int64_t r = r0; r < r1; ++r) {
    float m = p.in_dtype != NV_IN_FP32 ? row_max16(x, r * k, k, p.in_dtype) : -1.0f;
    if (m < 0.0f) m = load_row(x, r * k, k, p.in_dtype, p, buf.data(), vmax.data(), flags);
    float& slot = part[r / p.rows];
    slot = std::max(slot, m);
  }
}
