"""Batch-invariant tensor-core kernels: strict execution at the price of a deterministic engine.

A row comes out of a GPU kernel with different bits in a batch of 8 and a batch of 512 for
one reason only: the kernel chose another *schedule* for the bigger call (a split over K
whose partial sums are added at the end, a reduction spread over more threads, an instruction
that adds the products in another order). The arithmetic of one tile is fixed by the hardware
and the compiler: a tensor-core ``mma`` adds its products into the accumulator the same way
whichever row or column of the tile an input sits in. So a kernel whose reduction order never
depends on the number of rows is batch-invariant while running at tensor-core speed. Every kernel here follows
that rule (as Thinking Machines' and SGLang's batch-invariant operations do):

* :func:`matmul` and :func:`grouped_matmul`: a program owns an output tile and walks all of K,
  in steps of 64, into one fp32 accumulator; nothing is split over K; bias, then the optional
  NVFP4 epilogue ``acc * (a_dec[m] * w_dec[n])``, then one rounding to the output dtype. The
  tile's shape is chosen per call for speed (:func:`tile_config`): the tensor-core
  instruction adds each output element's products in an order that does not depend on the
  tile's other rows or columns, so every shape gives a row the same bits. The grouped form runs
  the rows of many experts in one launch (a tile never straddles two experts), each tile
  computed exactly as the plain form computes it.
* :func:`mean_last` (the mean of RMSNorm) and :func:`log_softmax`: a row read in chunks of 1024
  in order, each chunk reduced by the same in-register tree, the chunk results added left to
  right (a small batch spreads a row's chunks over programs and adds their results in the
  same order).
* :func:`attention`: a program takes 64 or 128 (query head, query) rows of one key/value head
  (keys, values and the output tile move by TMA) and walks the keys in blocks of 64 with an
  online softmax, the blocks counted from the
  sequence's **first visible key**, not from slot 0. A prompt left-padded in a sampler's KV
  cache and the same prompt right-padded in a learner's batch therefore meet the same keys in
  the same blocks; blocks a query cannot see change nothing (``m`` stays, ``alpha = 1``,
  ``p = 0``). The keys are split into chunks of 256 (:data:`ATTENTION_CONFIG`) from that same
  key, one program per chunk, and a row of several chunks combines them in order.

The K steps, the chunk widths and the reduction shapes are those of SGLang's
``batch_invariant_ops`` (its Triton persistent matmul, ``log_softmax`` and ``mean_dim``), so a
sampler running SGLang's deterministic inference on the Triton matmul computes the same bits
as these kernels (checked on a GPU against SGLang's own functions). They are not the bits of
the portable element-wise ops (:mod:`libalign.strict.ops`): tensor cores add in their own
order, and ``exp``/``log`` are the GPU's. What they share with those is the guarantee: row ``i``
gives the same bits alone, in a batch of 512, in a prefill or in a decode step.
"""

from __future__ import annotations

import functools

import torch

from libalign.errors import ConfigError, DTypeError, ShapeError

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = [
    "CONFIGS",
    "attention",
    "attention_config",
    "available",
    "group_tiles",
    "grouped_matmul",
    "log_softmax",
    "matmul",
    "mean_last",
    "require",
    "tile_config",
]

#: The tile configuration per operand dtype: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
#: fp32 operands multiply in IEEE fp32 (no TF32).
CONFIGS = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 256, 64, 8, 3),
    torch.float32: (128, 128, 32, 8, 3),
}
#: Narrower configurations, for products whose :data:`CONFIGS` grid would leave the GPU
#: short of programs (few rows, few output columns, or many small experts). Only the
#: output tile's shape, the warps and the pipeline depth differ; K is walked in the same
#: steps by the same tensor-core instruction, which adds each output element's products in
#: an order that does not depend on the tile's other rows or columns, so a row gets the bits
#: :data:`CONFIGS` gives it (checked on a GPU for every dtype and these shapes).
#: ``SMALL_CONFIGS``: 64-row tiles; ``WIDE_CONFIGS``: 64 rows and 256 columns, for a few rows
#: against a very wide weight (an LM head).
SMALL_CONFIGS = {
    torch.bfloat16: (64, 128, 64, 4, 4),
    torch.float16: (64, 128, 64, 4, 4),
    torch.float32: (64, 128, 32, 4, 3),
}
WIDE_CONFIGS = {
    torch.bfloat16: (64, 256, 64, 8, 3),
    torch.float16: (64, 256, 64, 8, 3),
    torch.float32: (64, 128, 32, 4, 3),
}
SMALL_M = 64
_WIDE_N = 16384
_CHUNK = 1024          # row chunk of the row reductions
_ATT_BLOCK = 64        # keys per step in attention
_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    """The multiprocessor count of CUDA ``device``, looked up once."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when a TMA descriptor can address it (16-byte aligned base, unit last
    stride, every other stride a multiple of 16 bytes), else a contiguous copy."""
    size = x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
            (st * size) % 16 == 0 for st in x.stride()[:-1]):
        return x
    return x.contiguous()


def available(x: torch.Tensor) -> bool:
    """Whether these kernels serve ``x``: a CUDA tensor with Triton present."""
    return triton is not None and x.is_cuda


def require(op: str, x: torch.Tensor) -> None:
    """:class:`~libalign.errors.ConfigError` naming ``op`` unless the kernels serve ``x``."""
    if not x.is_cuda:
        raise ConfigError(f"strict {op}: the tensor-core kernels run on CUDA tensors, got "
                          f"{x.device.type}")
    if triton is None:
        raise ConfigError(f"strict {op}: the batch-invariant kernels need Triton, which this torch "
                          "build lacks; strict device mode has no non-invariant fallback")


if triton is not None:

    @triton.jit
    def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, adec_ptr, wdec_ptr,
                       tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                       M, N, K, s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn, s_de,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
                       IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if GROUPED:
            e = tl.load(tile_e_ptr + pid_m).to(tl.int64)
            start_m = tl.load(tile_lo_ptr + pid_m)
            end_m = tl.load(tile_hi_ptr + pid_m)
        else:
            e = 0
            start_m = pid_m * BLOCK_M
            end_m = M
        offs_am = start_m + tl.arange(0, BLOCK_M)
        offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows and columns past the end read row / column 0 (their results are never stored)
        offs_am = tl.where(offs_am < end_m, offs_am, 0).to(tl.int64)
        offs_bn = tl.where(offs_bn < N, offs_bn, 0).to(tl.int64)
        offs_kk = tl.arange(0, BLOCK_K)
        b_base = b_ptr + e * s_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BLOCK_K)):
            offs_k = ki * BLOCK_K + offs_kk
            a = tl.load(a_ptr + offs_am[:, None] * s_am + offs_k[None, :] * s_ak,
                        mask=offs_kk[None, :] < K - ki * BLOCK_K, other=0.0)
            b = tl.load(b_base + offs_k[:, None] * s_bk + offs_bn[None, :] * s_bn,
                        mask=offs_kk[:, None] < K - ki * BLOCK_K, other=0.0)
            if IEEE:  # noqa: SIM108 - a constexpr branch, compiled once per kernel variant
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        offs_cm = start_m + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_cm < end_m
        n_ok = offs_cn < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_cn, mask=n_ok, other=0.0).to(tl.float32)
        if SCALED:
            ad = tl.load(adec_ptr + offs_cm, mask=m_ok, other=0.0)
            wd = tl.load(wdec_ptr + e * s_de + offs_cn, mask=n_ok, other=0.0)
            acc = acc * (ad[:, None] * wd[None, :])
        c = c_ptr + offs_cm.to(tl.int64)[:, None] * s_cm + offs_cn.to(tl.int64)[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _mean_kernel(x_ptr, out_ptr, s_xm, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        acc = 0.0
        for start in range(0, N, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            vals = tl.load(x_ptr + row * s_xm + offs, mask=offs < N, other=0.0)
            acc += tl.sum(vals)
        tl.store(out_ptr + row, acc / N)

    @triton.jit
    def _log_softmax_kernel(x_ptr, out_ptr, s_xm: tl.constexpr, s_om: tl.constexpr,
                            N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * s_xm
        o_row = out_ptr + row * s_om
        offs0 = tl.arange(0, BLOCK)
        top = tl.max(tl.load(x_row + offs0, mask=offs0 < N, other=-float("inf")))
        for start in range(BLOCK, N, BLOCK):
            offs = start + offs0
            vals = tl.load(x_row + offs, mask=offs < N, other=-float("inf"))
            top = tl.max(tl.maximum(vals, top))
        total = tl.sum(tl.zeros([1], dtype=top.dtype))
        for start in range(0, N, BLOCK):
            offs = start + offs0
            ok = offs < N
            vals = tl.load(x_row + offs, mask=ok, other=0.0)
            total += tl.sum(tl.where(ok, tl.exp(vals - top), 0.0))
        lse = tl.log(total)
        for start in range(0, N, BLOCK):
            offs = start + offs0
            ok = offs < N
            vals = tl.load(x_row + offs, mask=ok)
            tl.store(o_row + offs, vals - top - lse, mask=ok)

    @triton.jit
    def _chunk_max_kernel(x_ptr, part_ptr, s_xm: tl.constexpr, N: tl.constexpr,
                          NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, c): the maximum of chunk c (max is exact, so any split gives the
        # row maximum the one-program kernel finds)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        vals = tl.load(x_ptr + row * s_xm + offs, mask=offs < N, other=-float("inf"))
        tl.store(part_ptr + row * NCHUNK + c, tl.max(vals))

    @triton.jit
    def _row_top(part_ptr, row, NCHUNK: tl.constexpr, NCHUNK_P2: tl.constexpr):
        """The row maximum from its chunk maxima (exact)."""
        j = tl.arange(0, NCHUNK_P2)
        return tl.max(tl.load(part_ptr + row * NCHUNK + j, mask=j < NCHUNK, other=-float("inf")))

    @triton.jit
    def _chunk_sum_kernel(x_ptr, part_ptr, sum_ptr, s_xm: tl.constexpr, N: tl.constexpr,
                          NCHUNK: tl.constexpr, NCHUNK_P2: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, c): the row maximum from the chunk maxima, then chunk c's sum of
        # exp(x - max), reduced exactly as the one-program kernel reduces that chunk
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        top = _row_top(part_ptr, row, NCHUNK, NCHUNK_P2)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        vals = tl.load(x_ptr + row * s_xm + offs, mask=ok, other=0.0)
        tl.store(sum_ptr + row * NCHUNK + c, tl.sum(tl.where(ok, tl.exp(vals - top), 0.0)))

    @triton.jit
    def _chunk_out_kernel(x_ptr, out_ptr, part_ptr, sum_ptr, s_xm: tl.constexpr,
                          s_om: tl.constexpr, N: tl.constexpr, NCHUNK: tl.constexpr,
                          NCHUNK_P2: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, c): the chunk sums added left to right from 0 (the one-program
        # kernel's running total), the log, then chunk c's outputs
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        top = _row_top(part_ptr, row, NCHUNK, NCHUNK_P2)
        total = tl.sum(tl.zeros([1], dtype=top.dtype))
        for i in range(NCHUNK):
            total += tl.load(sum_ptr + row * NCHUNK + i)
        lse = tl.log(total)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        vals = tl.load(x_ptr + row * s_xm + offs, mask=ok)
        tl.store(out_ptr + row * s_om + offs, vals - top - lse, mask=ok)

    @triton.jit
    def _visible_kernel(mask_ptr, first_ptr, hi_ptr, count_ptr, bits_ptr, Tk, W, s_mr,
                        BLOCK: tl.constexpr):
        # program r: mask row r's first visible key (Tk when none), last visible key + 1 (0
        # when none), number of visible keys, all exact whatever the chunking, and the row
        # packed 64 keys a word (key j is bit j % 64 of word j // 64; W - 1 words, then a
        # zero word that a block straddling the row's end reads)
        r = tl.program_id(0).to(tl.int64)
        first = Tk
        hi = Tk * 0
        count = Tk * 0
        bit = tl.arange(0, 64).to(tl.int64)
        for start in range(0, Tk, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            seen = tl.load(mask_ptr + r * s_mr + offs, mask=offs < Tk, other=0) != 0
            first = tl.minimum(first, tl.min(tl.where(seen, offs, Tk)))
            hi = tl.maximum(hi, tl.max(tl.where(seen, offs + 1, 0)))
            count += tl.sum(seen.to(tl.int32))
            words = tl.sum(tl.reshape(seen.to(tl.int64), (BLOCK // 64, 64)) << bit[None, :], 1)
            w = start // 64 + tl.arange(0, BLOCK // 64)
            tl.store(bits_ptr + r * W + w, words, mask=w < W - 1)
        tl.store(bits_ptr + r * W + W - 1, tl.zeros((), tl.int64))
        tl.store(first_ptr + r, first)
        tl.store(hi_ptr + r, hi)
        tl.store(count_ptr + r, count)

    @triton.jit
    def _sequence_base(first_ptr, b, Tk, HM, Tq, SCAN: tl.constexpr):
        """Sequence ``b``'s first visible key over all its mask rows (``Tk`` when none; exact:
        a minimum)."""
        base = Tk
        for start in range(0, HM * Tq, SCAN):
            offs = start + tl.arange(0, SCAN)
            base = tl.minimum(base, tl.min(tl.load(first_ptr + b * HM * Tq + offs,
                                                   mask=offs < HM * Tq, other=Tk)))
        return base

    @triton.jit
    def _chunk_count(his, base, CHUNK: tl.constexpr):
        """How many key chunks of ``CHUNK`` from ``base`` rows ending at ``his`` span."""
        return tl.where(his > base, (his - base + CHUNK - 1) // CHUNK, 0)

    @triton.jit
    def _key_block(q, k_desc, v_desc, b, hk, start, scaling, lo_r, his, brow, m_i, l_i, acc,
                   D: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        """One block of ``BLOCK`` (64) keys from ``start`` into a tile's online softmax:
        scores, the rows' visibility (their key interval; with ``MASKED``, the packed mask
        bits of the rows, words ``brow``), then ``m``, ``l`` and the output rescaled."""
        offs_k = start + tl.arange(0, BLOCK)
        k = tl.reshape(k_desc.load([b, hk, start, 0]), (BLOCK, D))  # zeros past Tk
        s = tl.dot(q, tl.trans(k)) * scaling
        if MASKED:  # the 64 bits from key `start` on: the end of one word, the start of the next
            first = tl.full((), 0, tl.int32) + start  # a tensor even where start is an int
            sh = (first % 64).to(tl.uint64)
            w0 = tl.load(brow + first // 64).to(tl.uint64, bitcast=True)
            w1 = tl.load(brow + first // 64 + 1).to(tl.uint64, bitcast=True)
            word = (w0 >> sh) | tl.where(sh == 0, 0, w1 << ((64 - sh) % 64))
            seen = ((word[:, None] >> tl.arange(0, BLOCK).to(tl.uint64)[None, :]) & 1) != 0
        else:
            seen = (offs_k[None, :] >= lo_r[:, None]) & (offs_k[None, :] < his[:, None])
        s = tl.where(seen, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.reshape(v_desc.load([b, hk, start, 0]), (BLOCK, D))
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        return m_new, l_i, acc

    @triton.jit
    def _key_range(q, k_desc, v_desc, b, hk, lo, hi_k, scaling, lo_r, his, brow, all_span,
                   D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr):
        """The online softmax of keys ``lo`` .. ``hi_k`` from a fresh state: each row's
        maximum, sum and unnormalised output. ``all_span``: every row sees one interval."""
        m_i = tl.full((BLOCK_Q,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, D), tl.float32)
        if all_span:  # the common case: no mask bits read
            for start in range(lo, hi_k, BLOCK):
                m_i, l_i, acc = _key_block(q, k_desc, v_desc, b, hk, start, scaling, lo_r, his,
                                           brow, m_i, l_i, acc, D, BLOCK, False)
        else:
            for start in range(lo, hi_k, BLOCK):
                m_i, l_i, acc = _key_block(q, k_desc, v_desc, b, hk, start, scaling, lo_r, his,
                                           brow, m_i, l_i, acc, D, BLOCK, True)
        return m_i, l_i, acc

    @triton.jit
    def _fold(top, total, out, m_c, l_c, acc_c, use):
        """Chunk ``c``'s (max, sum, output) folded into the rows' running (max, sum, output)
        where ``use``: both rescaled to the new maximum, the products added by explicit fused
        multiply-adds (so every kernel that folds rounds alike). From (-inf, 0, 0) the first
        chunk's state comes out exactly."""
        new = tl.maximum(top, m_c)
        shift = tl.where(new == -float("inf"), 0.0, new)
        keep = tl.exp(top - shift)
        take = tl.exp(m_c - shift)
        total_n = tl.fma(l_c, take, total * keep)
        out_n = tl.fma(acc_c, take[:, None], out * keep[:, None])
        return (tl.where(use, new, top), tl.where(use, total_n, total),
                tl.where(use[:, None], out_n, out))

    @triton.jit
    def _attention_kernel(q_ptr, k_desc, v_desc, o_desc, bits_ptr, first_ptr, hi_ptr, count_ptr,
                          Tq, Tk, HKV, REP, HM, scaling, W, s_qb, s_qh, s_qt,
                          ws_m_ptr, ws_l_ptr, ws_desc, R, HQ,
                          D: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK_Q: tl.constexpr, SERIAL: tl.constexpr):
        # rows of a program: (query head, query) pairs of one sequence and one key/value head,
        # REP * Tq of them in head-major order, so a decode step's REP heads share one tile
        # and one read of the keys; a row's arithmetic never depends on its tile companions.
        # Keys and values arrive by TMA, and the tile leaves by TMA (rows past REP * Tq fall
        # outside the descriptors' bounds): no per-element addresses held in registers.
        # A row's keys are cut in chunks of CHUNK from its sequence's first visible key; each
        # chunk's softmax starts fresh and the chunks fold in order (_fold). SERIAL: this
        # program walks its rows' chunks itself; else program c of axis 2 takes chunk c and
        # leaves a row of several chunks to _combine_kernel, which folds the same way.
        pid_v = tl.program_id(0)
        bk = tl.program_id(1)
        b = bk // HKV
        hk = bk % HKV
        vr = pid_v * BLOCK_Q + tl.arange(0, BLOCK_Q)
        v_ok = vr < REP * Tq
        vr = tl.where(v_ok, vr, 0)
        t = (vr % Tq).to(tl.int64)
        h = hk.to(tl.int64) * REP + (vr // Tq).to(tl.int64)
        hm = tl.where(HM == 1, 0, h)  # the mask's head: its only one, or the query's
        b64 = b.to(tl.int64)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + b64 * s_qb + h[:, None] * s_qh + t[:, None] * s_qt + offs_d[None, :],
                    mask=v_ok[:, None], other=0.0)
        base = _sequence_base(first_ptr, b64, Tk, HM, Tq, SCAN)
        row = (b64 * HM + hm) * Tq + t
        lo_r = tl.load(first_ptr + row, mask=v_ok, other=0)
        his = tl.load(hi_ptr + row, mask=v_ok, other=0)
        # a row whose visible keys are one interval (causal, padded) needs no mask reads
        span = tl.load(count_ptr + row, mask=v_ok, other=0) == his - lo_r
        all_span = tl.min(tl.where(v_ok, span, True).to(tl.int32)) == 1
        stop = tl.max(his)
        brow = bits_ptr + row * W
        if CHUNK == 0:
            m_i, l_i, acc = _key_range(q, k_desc, v_desc, b, hk, base, stop, scaling, lo_r, his,
                                       brow, all_span, D, BLOCK, BLOCK_Q)
            out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
            o_desc.store([bk, pid_v * BLOCK_Q, 0], tl.reshape(out.to(o_desc.dtype),
                                                            (1, BLOCK_Q, D)))
        elif SERIAL:
            chunks = _chunk_count(his, base, CHUNK)
            top = tl.full((BLOCK_Q,), -float("inf"), tl.float32)
            total = tl.zeros((BLOCK_Q,), tl.float32)
            out = tl.zeros((BLOCK_Q, D), tl.float32)
            for c in range(0, tl.max(chunks)):
                lo = base + c * CHUNK
                m_c, l_c, acc_c = _key_range(q, k_desc, v_desc, b, hk, lo,
                                             tl.minimum(lo + CHUNK, stop), scaling, lo_r, his,
                                             brow, all_span, D, BLOCK, BLOCK_Q)
                top, total, out = _fold(top, total, out, m_c, l_c, acc_c, c < chunks)
            out = tl.where(total[:, None] > 0, out / tl.where(total > 0, total, 1.0)[:, None],
                           0.0)
            o_desc.store([bk, pid_v * BLOCK_Q, 0], tl.reshape(out.to(o_desc.dtype),
                                                            (1, BLOCK_Q, D)))
        else:
            c = tl.program_id(2)
            chunks = _chunk_count(his, base, CHUNK)
            lo = base + c * CHUNK
            m_i, l_i, acc = _key_range(q, k_desc, v_desc, b, hk, lo, tl.minimum(lo + CHUNK, stop),
                                       scaling, lo_r, his, brow, all_span, D, BLOCK, BLOCK_Q)
            # chunk 0 writes every row (a row of one chunk ends here: its fold is the identity);
            # a row of several also leaves its chunk's state for _combine_kernel, which then
            # overwrites the row
            if c == 0:
                out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
                o_desc.store([bk, pid_v * BLOCK_Q, 0], tl.reshape(out.to(o_desc.dtype),
                                                                (1, BLOCK_Q, D)))
            part = v_ok & (chunks > 1) & (c < chunks)
            if tl.max(part.to(tl.int32)) > 0:
                g = c.to(tl.int64) * R + (b64 * HQ + h) * Tq + t
                tl.store(ws_m_ptr + g, m_i, mask=part)
                tl.store(ws_l_ptr + g, l_i, mask=part)
                ws_desc.store([c, bk, pid_v * BLOCK_Q, 0], tl.reshape(acc, (1, 1, BLOCK_Q, D)))

    @triton.jit
    def _combine_kernel(o_ptr, first_ptr, hi_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
                        Tq, Tk, HQ, HM, NC, R, s_ob, s_oh, s_ot,
                        D: tl.constexpr, ROWS: tl.constexpr, SCAN: tl.constexpr,
                        CHUNK: tl.constexpr):
        # rows of more than one chunk: the chunks' states folded in chunk order (_fold), then
        # one division
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        r = pid * ROWS + tl.arange(0, ROWS)  # (head, query) rows of sequence b
        r_ok = r < HQ * Tq
        r = tl.where(r_ok, r, 0)
        h = (r // Tq).to(tl.int64)
        t = (r % Tq).to(tl.int64)
        hm = tl.where(HM == 1, 0, h)
        base = _sequence_base(first_ptr, b, Tk, HM, Tq, SCAN)
        his = tl.load(hi_ptr + (b * HM + hm) * Tq + t, mask=r_ok, other=0)
        chunks = _chunk_count(his, base, CHUNK)
        mine = r_ok & (chunks > 1)
        g0 = (b * HQ + h) * Tq + t  # chunk c's state is at c * R + g0
        offs_d = tl.arange(0, D)
        top = tl.full((ROWS,), -float("inf"), tl.float32)
        total = tl.zeros((ROWS,), tl.float32)
        out = tl.zeros((ROWS, D), tl.float32)
        for c in range(0, NC):
            use = mine & (c < chunks)
            m_c = tl.load(ws_m_ptr + c * R + g0, mask=use, other=-float("inf"))
            l_c = tl.load(ws_l_ptr + c * R + g0, mask=use, other=0.0)
            acc_c = tl.load(ws_acc_ptr + (c * R + g0)[:, None] * D + offs_d[None, :],
                            mask=use[:, None], other=0.0)
            top, total, out = _fold(top, total, out, m_c, l_c, acc_c, use)
        out = tl.where(total[:, None] > 0, out / tl.where(total > 0, total, 1.0)[:, None], 0.0)
        tl.store(o_ptr + b * s_ob + h[:, None] * s_oh + t[:, None] * s_ot + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mine[:, None])


def tile_config(dtype: torch.dtype, rows: int, op: str = "matmul", *, n: int = 0,
                row_tiles: int | None = None, sms: int = 0) -> tuple[int, ...]:
    """The tile configuration of a product of ``rows`` rows (the rows of one expert, for a
    grouped call) and ``n`` output columns, by speed alone (every configuration gives a row
    the same bits): :data:`WIDE_CONFIGS` for at most :data:`SMALL_M` rows against a very wide
    weight, :data:`SMALL_CONFIGS` for other calls of at most :data:`SMALL_M` rows and for
    calls whose :data:`CONFIGS` grid (``row_tiles`` 128-row tiles, default ``rows / 128``,
    times the column tiles) has fewer than two programs per multiprocessor (``sms``), else
    :data:`CONFIGS`."""
    if dtype not in CONFIGS:
        raise DTypeError(f"strict {op}: the tensor-core kernels take bf16, fp16 or fp32 operands, "
                         f"got {dtype}")
    if rows <= SMALL_M:
        return (WIDE_CONFIGS if n >= _WIDE_N else SMALL_CONFIGS)[dtype]
    tiles = (row_tiles if row_tiles is not None else -(-rows // 128)) * -(-n // 128)
    return SMALL_CONFIGS[dtype] if tiles < 2 * sms else CONFIGS[dtype]


def _launch_matmul(a, w, out, *, bias=None, a_dec=None, w_dec=None, tiles=None,
                   config=None) -> None:
    bm, bn, bk, warps, stages = config or tile_config(
        a.dtype, a.shape[0], n=out.shape[1], sms=_sms(a.device))
    grouped = tiles is not None
    m, k = a.shape
    n = out.shape[1]
    w3 = w if w.ndim == 3 else w.unsqueeze(0)
    dummy = out
    te, tlo, thi = tiles if grouped else (dummy, dummy, dummy)
    n_mtiles = te.shape[0] if grouped else triton.cdiv(m, bm)
    if n_mtiles == 0 or n == 0:
        return
    wdec = w_dec if w_dec is not None else dummy
    with torch.cuda.device(a.device):
        _matmul_kernel[(n_mtiles, triton.cdiv(n, bn))](
            a, w3, out, bias if bias is not None else dummy,
            a_dec if a_dec is not None else dummy, wdec, te, tlo, thi,
            m, n, k, a.stride(0), a.stride(1), w3.stride(0), w3.stride(2), w3.stride(1),
            out.stride(0), out.stride(1), wdec.stride(0) if w_dec is not None and wdec.ndim == 2
            else 0,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUPED=grouped, HAS_BIAS=bias is not None,
            SCALED=a_dec is not None, IEEE=a.dtype == torch.float32,
            num_warps=warps, num_stages=stages)


def _check_operands(op: str, a: torch.Tensor, w: torch.Tensor, w_rank: int) -> None:
    require(op, a)
    if a.ndim != 2 or w.ndim != w_rank or a.shape[1] != w.shape[-1]:
        want = "[N, K]" if w_rank == 2 else "[E, N, K]"
        raise ShapeError(f"strict {op} needs a [M, K] and w {want}, got {tuple(a.shape)} and "
                         f"{tuple(w.shape)}")
    if a.dtype != w.dtype:
        raise DTypeError(f"strict {op}: a is {a.dtype}, w is {w.dtype}; the tile products need one "
                         "operand dtype")
    if a.device != w.device:
        raise ShapeError(f"strict {op}: a on {a.device}, w on {w.device}")


def matmul(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None,
           config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``a @ w.T (+ bias)``: ``a`` ``[M, K]``, ``w`` ``[N, K]`` (any strides), fp32 accumulation,
    one rounding to ``out_dtype`` (default ``a``'s); row ``i`` the same bits for every ``M``.
    ``config`` overrides :func:`tile_config` (a probe comparing tile shapes)."""
    _check_operands("matmul", a, w, 2)
    if config is not None and config[2] != tile_config(a.dtype, 0)[2]:
        raise ShapeError(f"strict matmul: tile config {config} steps K by {config[2]}, the "
                         f"kernels by {tile_config(a.dtype, 0)[2]}")
    out = torch.empty((a.shape[0], w.shape[0]), dtype=out_dtype or a.dtype, device=a.device)
    if a.shape[1] == 0:
        out.zero_()
        if bias is not None:
            out += bias.float().to(out.dtype)
        return out
    _launch_matmul(a, w, out, bias=bias, config=config)
    return out


def group_tiles(counts: list[int], device: torch.device,
                rows: int = CONFIGS[torch.bfloat16][0]) -> tuple[torch.Tensor, ...]:
    """The grouped launch's row tiles of ``rows`` rows from per-expert row counts (rows sorted
    by expert): ``(expert, first row, end row)`` per tile, int32 on ``device``; a tile never
    holds two experts' rows. A MoE layer's FC1 and FC2 share their counts, so the last few
    tables are kept (read-only) rather than built and copied twice."""
    return _tiles(tuple(counts), torch.device(device), rows)


@functools.lru_cache(maxsize=8)
def _tiles(counts: tuple[int, ...], device: torch.device, bm: int) -> tuple[torch.Tensor, ...]:
    es, los, his = [], [], []
    lo = 0
    for e, n in enumerate(counts):
        for start in range(lo, lo + n, bm):
            es.append(e)
            los.append(start)
            his.append(lo + n)
        lo += n
    t = torch.tensor([es, los, his], dtype=torch.int32).to(device, non_blocking=True)
    return t[0], t[1], t[2]


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, counts: list[int], *,
                   out_dtype: torch.dtype, a_dec: torch.Tensor | None = None,
                   w_dec: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``a`` ``[M, K]`` sorted by expert (``counts[e]`` rows of expert ``e``) times their
    expert's ``w[e]`` ``[N, K]`` (``w`` ``[E, N, K]``), in one launch; each row's bits those of
    :func:`matmul` of that row alone. With ``a_dec`` ``[M]`` and ``w_dec`` ``[E, N]`` (fp32) the
    NVFP4 epilogue ``acc * (a_dec[m] * w_dec[e, n])`` runs before the rounding."""
    _check_operands("grouped_matmul", a, w, 3)
    if sum(counts) != a.shape[0] or len(counts) > w.shape[0]:
        raise ShapeError(f"strict grouped_matmul: counts add to {sum(counts)} over {len(counts)} "
                         f"experts, a has {a.shape[0]} rows, w {w.shape[0]} experts")
    if (a_dec is None) != (w_dec is None):
        raise ShapeError("strict grouped_matmul: a_dec and w_dec come together")
    out = torch.empty((a.shape[0], w.shape[1]), dtype=out_dtype, device=a.device)
    if a.shape[1] == 0:
        return out.zero_()
    if a_dec is not None:
        a_dec = a_dec.float().contiguous()
        w_dec = w_dec.float().reshape(w.shape[0], w.shape[1]).contiguous()
    # the experts' row counts pick the configuration (every one gives the same bits): 64-row
    # tiles when the experts hold 256 rows or fewer on average (a decode step, or a prefill
    # spread over many experts: less of each tile is padding), else tile_config's choice
    busy = [c for c in counts if c]
    per_expert = -(-sum(busy) // max(1, len(busy)))
    if per_expert <= 4 * SMALL_M:
        cfg = tile_config(a.dtype, SMALL_M, "grouped_matmul")
    else:
        cfg = tile_config(a.dtype, per_expert, "grouped_matmul", n=w.shape[1],
                          row_tiles=sum(-(-c // 128) for c in busy), sms=_sms(a.device))
    _launch_matmul(a, w, out, a_dec=a_dec, w_dec=w_dec, config=cfg,
                   tiles=group_tiles(counts, a.device, cfg[0]))
    return out


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """The fp32 mean over the last dimension, keepdim: chunks of 1024 reduced in order."""
    require("mean", x)
    if x.dtype != torch.float32:
        raise DTypeError(f"strict mean takes fp32, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        with torch.cuda.device(x.device):
            _mean_kernel[(x2.shape[0],)](x2, out, x2.stride(0), x2.shape[1], BLOCK=_CHUNK)
    return out.reshape(*x.shape[:-1], 1)


#: Up to this many rows, :func:`log_softmax` spreads each row over one program per chunk.
SPLIT_ROWS = 64


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dimension: ``x - max - log(sum(exp(x - max)))``, the sum
    over chunks of 1024 in order (the GPU's ``exp`` and ``log``).

    A batch of more than :data:`SPLIT_ROWS` rows runs one program per row, walking its chunks
    three times (maximum, sum, output). A smaller batch would leave most of the GPU idle that
    way, so it runs the same arithmetic over one program per (row, chunk) in three launches:
    chunk maxima; each chunk's ``sum(exp(x - max))``, reduced as the one-program kernel reduces
    it; then the chunk sums added left to right from 0, the log and the outputs. Both give a
    row the same bits (the maximum is exact whatever the split; every rounded step is the
    same operation on the same values in the same order), so rows stay batch-invariant."""
    require("log_softmax", x)
    xf = x.float().reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(xf)
    rows, n = xf.shape
    if not xf.numel():
        return out.reshape(x.shape)
    with torch.cuda.device(x.device):
        if rows > SPLIT_ROWS:
            _log_softmax_kernel[(rows,)](xf, out, xf.stride(0), out.stride(0), n, BLOCK=_CHUNK)
        else:
            nchunk = triton.cdiv(n, _CHUNK)
            top = torch.empty((rows, nchunk), dtype=torch.float32, device=x.device)
            sums = torch.empty_like(top)
            grid = (rows, nchunk)
            p2 = triton.next_power_of_2(nchunk)
            _chunk_max_kernel[grid](xf, top, xf.stride(0), n, NCHUNK=nchunk, BLOCK=_CHUNK)
            _chunk_sum_kernel[grid](xf, top, sums, xf.stride(0), n, NCHUNK=nchunk,
                                    NCHUNK_P2=p2, BLOCK=_CHUNK)
            _chunk_out_kernel[grid](xf, out, top, sums, xf.stride(0), out.stride(0), n,
                                    NCHUNK=nchunk, NCHUNK_P2=p2, BLOCK=_CHUNK)
    return out.reshape(x.shape)


#: Attention's (warps, pipeline stages, key chunk, query rows per program) for calls of at
#: most 64 (query head, query) rows per key/value head (a decode step). The key chunk (a
#: multiple of 64, or 0) splits the keys a row sees into chunks of that many from its
#: sequence's first visible key, each chunk's online softmax run by its own program and the
#: chunks combined in order; it is part of a row's bits, so every setting shares it. Keys are
#: always walked in blocks of 64.
ATTENTION_CONFIG = (4, 3, 256, 64)
#: The same for larger calls (a prefill): 128 query rows a program on 8 warps. Tiles of 64 and
#: 128 rows, on 4 or 8 warps, give a row the same bits (the tensor-core instruction is the
#: same; checked on a GPU, and decode against prefill in the tests).
ATTENTION_CONFIG_LARGE = (8, 3, 256, 128)


def attention_config(rows: int) -> tuple[int, int, int, int]:
    """The attention setting of a call with ``rows`` (query head, query) rows per key/value
    head: :data:`ATTENTION_CONFIG` up to 64, else :data:`ATTENTION_CONFIG_LARGE`."""
    return ATTENTION_CONFIG if rows <= 64 else ATTENTION_CONFIG_LARGE


def _key_descriptor(x: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of keys or values ``[B, Hkv, Tk, D]`` whose box is one block of
    :data:`_ATT_BLOCK` keys of one sequence and head (reads past ``Tk`` give zeros)."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, _ATT_BLOCK, x.shape[-1]])


def visible_range(allowed: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's first visible key (``Tk`` when none), last visible key + 1 (0 when none) and
    number of visible keys, of a boolean mask ``[B, Hm, Tq, Tk]``: int32 ``[B, Hm, Tq]`` each;
    and the mask packed 64 keys a word, int64 ``[B * Hm * Tq, ceil(Tk / 64) + 1]`` (key ``j``
    is bit ``j % 64`` of word ``j // 64``; the last word is zero). One launch. A row whose
    count is ``hi - first`` sees one interval of keys."""
    b, hm, tq, tk = allowed.shape
    rows = allowed.reshape(b * hm * tq, tk)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    first = torch.empty((b, hm, tq), dtype=torch.int32, device=allowed.device)
    hi, count = torch.empty_like(first), torch.empty_like(first)
    bits = torch.empty((b * hm * tq, triton.cdiv(tk, 64) + 1), dtype=torch.int64,
                       device=allowed.device)
    if first.numel() and tk:
        _visible_kernel[(b * hm * tq,)](rows.view(torch.uint8), first, hi, count, bits, tk,
                                        bits.shape[1], rows.stride(0),
                                        BLOCK=max(64, min(1024, triton.next_power_of_2(tk))))
    elif first.numel():
        for t in (first, hi, count, bits):
            t.fill_(0)
    return first, hi, count, bits


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              scaling: float, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Masked softmax attention ``[B, Hq, Tq, D]`` (grouped-query: ``Hq`` a multiple of ``Hkv``):
    ``q`` ``[B, Hq, Tq, D]``, ``k``, ``v`` ``[B, Hkv, Tk, D]`` (bf16 or fp16), ``allowed``
    ``[B, 1|Hq, Tq, Tk]`` (True = attend). Keys in blocks of 64 from each sequence's first
    visible key; a query that sees no key gets zeros. A program takes 64 or 128 (query head,
    query) rows of one key/value head (:func:`attention_config`), so a decode step's grouped
    heads read the keys once. ``config`` (warps, stages, key chunk, query rows) overrides
    that choice (a probe; the key chunk is part of the rows' bits)."""
    require("attention", q)
    b, hq, tq, d = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or hq % k.shape[1] \
            or k.shape[-1] != d:
        raise ShapeError(f"strict attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"strict attention takes bf16 or fp16 q, k, v of one dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if d not in (16, 32, 64, 128, 256):
        raise ShapeError(f"strict attention: head dimension {d} (the kernel takes 16, 32, 64, "
                         "128 or 256)")
    tk = k.shape[2]
    if allowed.shape[0] != b or allowed.shape[1] not in (1, hq) or allowed.shape[2] != tq \
            or allowed.shape[3] != tk or allowed.dtype != torch.bool:
        raise ShapeError(f"strict attention mask {tuple(allowed.shape)} {allowed.dtype} for q "
                         f"{tuple(q.shape)} and {tk} keys (a bool mask [B, 1|Hq, Tq, Tk])")
    out = torch.empty((b, hq, tq, d), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if tk == 0:  # no keys: every query sees none
        return out.zero_()
    hm = allowed.shape[1]
    qc = q if q.stride(-1) == 1 else q.contiguous()
    kc, vc = _tma_ready(k), _tma_ready(v)
    hkv = k.shape[1]
    rep = hq // hkv
    rows = rep * tq  # a key/value head's (query head, query) rows, contiguous in `out`
    warps, stages, chunk, block_q, *serial = config or attention_config(rows)
    if chunk % _ATT_BLOCK or chunk < 0:
        raise ShapeError(f"strict attention: key chunk {chunk} (a multiple of {_ATT_BLOCK}, or 0)")
    if block_q not in (16, 32, 64, 128):
        raise ShapeError(f"strict attention: {block_q} query rows per program (16, 32, 64 or "
                         "128)")
    nc = max(1, triton.cdiv(tk, chunk)) if chunk else 1
    serial = serial[0] if serial else rows > SMALL_M
    split = nc > 1 and not serial  # chunks on their own programs, folded by _combine_kernel
    o_desc = TensorDescriptor(out.view(b * hkv, rows, d), [b * hkv, rows, d], [rows * d, d, 1],
                              [1, block_q, d])
    if split:  # the states of rows that see more than one chunk: [chunk, B * Hq * Tq] (x D)
        ws_m = torch.empty((nc * b * hq * tq,), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((nc, b * hkv, rows, d), dtype=torch.float32, device=q.device)
        ws_desc = TensorDescriptor.from_tensor(ws_acc, [1, 1, block_q, d])
    else:
        ws_m = ws_l = ws_acc = out
        ws_desc = o_desc
    scan = min(1024, triton.next_power_of_2(hm * tq))
    with torch.cuda.device(q.device):
        first, hi, count, bits = visible_range(allowed)
        _attention_kernel[(triton.cdiv(rows, block_q), b * hkv, nc if split else 1)](
            qc, _key_descriptor(kc), _key_descriptor(vc), o_desc, bits, first, hi, count, tq, tk,
            hkv, rep, hm, float(scaling), bits.shape[1], *qc.stride()[:3], ws_m, ws_l, ws_desc,
            b * hq * tq, hq, D=d, BLOCK=_ATT_BLOCK, SCAN=scan, CHUNK=chunk if nc > 1 else 0,
            BLOCK_Q=block_q, SERIAL=serial, num_warps=warps, num_stages=stages)
        if split:
            _combine_kernel[(triton.cdiv(hq * tq, 16), b)](
                out, first, hi, ws_m, ws_l, ws_acc, tq, tk, hq, hm, nc, b * hq * tq,
                *out.stride()[:3], D=d, ROWS=16, SCAN=scan, CHUNK=chunk, num_warps=4)
    return out
