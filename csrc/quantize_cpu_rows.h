// The row driver of the CPU kernel, stamped once per instruction-set path.
//
// Not a standalone header: quantize_cpu.cpp includes it inside each path's namespace
// (nv_scalar, nv_avx2, nv_avx512) after that namespace has defined, for its instruction
// set,
//   float load_row(x, base, k, dtype, p, buf, vmax, flags)   widen a row, block maxima
//   void scale_blocks(vmax, nb, o, te_mult, p, sbytes, mult, div, undefined)
//   void encode_block(xb, enc, signed_zero, out)              16 values -> 8 bytes
//   float row_max16(x, base, k, dtype)                        16-bit row max, -1 if unknown
//   uint8_t fos_block(xb, v, o, amax, p, out)                 a 4-over-6 block -> byte, 8 bytes
// and, for the SIMD paths, inside that path's `#pragma GCC target` region: every copy of
// the driver is compiled for its own target and inlines its own helpers. The shared,
// target-neutral parts (RowQueue, row_outer, store_scales, mx_scale_blocks) come from
// quantize_cpu.cpp. An MXFP4 row (an MX op_order) shares the load and the 16-value
// encode step: its 32-value block takes its maximum from two 16-value maxima, its E8M0 byte
// and power-of-two multiplier from mx_scale_blocks, and both halves encode with that
// multiplier. A 4-over-6 row shares the load, then fos_block scales and encodes each block.

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

// Encode an MXFP4 row: mults holds each 16-value half-block's multiplier (both halves of a
// 32-value block share theirs); no MX order divides, so divs and sbytes are not read.
inline void encode_mx_row(const float* buf, const float* mults, const float* divs,
                          const uint8_t* sbytes, int64_t nb, int signed_zero, uint8_t* crow) {
  if (signed_zero == NV_SZ_POSITIVE)
    encode_row<NV_SZ_POSITIVE, false>(buf, mults, divs, sbytes, nb, crow);
  else if (signed_zero == NV_SZ_SIGN_OF_INPUT)
    encode_row<NV_SZ_SIGN_OF_INPUT, false>(buf, mults, divs, sbytes, nb, crow);
  else
    encode_row<NV_SZ_SIGN_OF_NONZERO, false>(buf, mults, divs, sbytes, nb, crow);
}

// The per-worker scratch of quantize_rows (one row widened, its block maxima and encoders).
struct RowScratch {
  explicit RowScratch(int64_t k)
      : nbp((k / 16 + 15) / 16 * 16),  // padded for 16-wide steps
        buf(static_cast<size_t>(k)), vmax(static_cast<size_t>(nbp)),
        mults(static_cast<size_t>(nbp)), divs(static_cast<size_t>(nbp)),
        sbytes(static_cast<size_t>(nbp)) {}
  int64_t nbp;
  std::vector<float> buf, vmax, mults, divs;
  std::vector<uint8_t> sbytes;
};

// Quantize row r of the flattened experts*rows matrix; flags OR-ed into *flags.
inline void quantize_row(int64_t r, const void* x, uint8_t* codes, uint8_t* scales,
                         float* amax_out, float* stored_out, const float* enc, const float* dec,
                         const NvParams& p, RowScratch& t, int* flags) {
  const int64_t k = p.k, nb = k / 16, e = r / p.rows, rr = r % p.rows;
  const float rowmax = load_row(x, r * k, k, p.in_dtype, p, t.buf.data(), t.vmax.data(), flags);
  if (*flags & NV_FLAG_NONFINITE) return;
  if (NV_IS_MX(p.op_order)) {  // MXFP4: E8M0 scales of 32-value blocks, no outer scale
    mx_scale_blocks(t.vmax.data(), nb, p.op_order, t.sbytes.data(), t.mults.data());
    store_scales(t.sbytes.data(), scales, p, r, e, rr, nb / 2);
    encode_mx_row(t.buf.data(), t.mults.data(), t.divs.data(), t.sbytes.data(), nb, p.signed_zero,
                  codes + r * (k / 2));
    return;
  }
  const NvOuter o = row_outer(rowmax, p, r, e, enc, dec, amax_out, stored_out);
  if (p.four_over_six != NV_FOS_OFF) {  // the outer maximum: this row's, or given
    const float a = p.outer_mode == NV_OUTER_ROW ? amax_out[r] : amax_out[p.outer_stride ? e : 0];
    uint8_t* crow = codes + r * (k / 2);
    for (int64_t b = 0; b < nb; ++b)
      t.sbytes[b] = fos_block(t.buf.data() + b * 16, t.vmax[b], o, a, p, crow + b * 8);
    store_scales(t.sbytes.data(), scales, p, r, e, rr, nb);
    return;
  }
  int undefined = 0;
  scale_blocks(t.vmax.data(), nb, o, nv_te_block_mult(o.enc), p, t.sbytes.data(), t.mults.data(),
               t.divs.data(), &undefined);
  if (undefined) *flags |= NV_FLAG_UNDEFINED_SCALE;
  store_scales(t.sbytes.data(), scales, p, r, e, rr, nb);
  uint8_t* crow = codes + r * (k / 2);
  const float* b = t.buf.data();
  const float* mu = t.mults.data();
  const float* dv = t.divs.data();
  const uint8_t* sb = t.sbytes.data();
  const int sz = p.signed_zero;
  if (p.op_order == NV_ORDER_MODELOPT) {
    if (sz == NV_SZ_POSITIVE) encode_row<NV_SZ_POSITIVE, true>(b, mu, dv, sb, nb, crow);
    else if (sz == NV_SZ_SIGN_OF_INPUT) encode_row<NV_SZ_SIGN_OF_INPUT, true>(b, mu, dv, sb, nb, crow);
    else encode_row<NV_SZ_SIGN_OF_NONZERO, true>(b, mu, dv, sb, nb, crow);
  } else {
    if (sz == NV_SZ_POSITIVE) encode_row<NV_SZ_POSITIVE, false>(b, mu, dv, sb, nb, crow);
    else if (sz == NV_SZ_SIGN_OF_INPUT) encode_row<NV_SZ_SIGN_OF_INPUT, false>(b, mu, dv, sb, nb, crow);
    else encode_row<NV_SZ_SIGN_OF_NONZERO, false>(b, mu, dv, sb, nb, crow);
  }
}

// Quantize the rows this worker takes from q; flags OR-ed into *flags. A NaN/Inf (when not
// saturated) stops the worker: the caller re-runs the spec, which raises.
void quantize_rows(const void* x, uint8_t* codes, uint8_t* scales, float* amax_out,
                   float* stored_out, const float* enc, const float* dec, const NvParams& p,
                   RowQueue& q, int* flags) {
  RowScratch t(p.k);
  int local = 0;
  int64_t r0, r1;
  while (!(local & NV_FLAG_NONFINITE) && q.take(&r0, &r1)) {
    for (int64_t r = r0; r < r1 && !(local & NV_FLAG_NONFINITE); ++r)
      quantize_row(r, x, codes, scales, amax_out, stored_out, enc, dec, p, t, &local);
  }
  *flags |= local;
}

// Maxima of the rows this worker takes from q, folded into part[expert] (the
// tensor/expert domains' pass).
void amax_rows(const void* x, const NvParams& p, RowQueue& q, float* part, int* flags) {
  const int64_t k = p.k, nb = k / 16;
  std::vector<float> buf(static_cast<size_t>(k)), vmax(static_cast<size_t>(nb));
  int64_t r0, r1;
  while (q.take(&r0, &r1)) {
    for (int64_t r = r0; r < r1; ++r) {
      float m = p.in_dtype != NV_IN_FP32 ? row_max16(x, r * k, k, p.in_dtype) : -1.0f;
      if (m < 0.0f) m = load_row(x, r * k, k, p.in_dtype, p, buf.data(), vmax.data(), flags);
      float& slot = part[r / p.rows];
      slot = std::max(slot, m);
    }
  }
}
