"""Batch-invariant attention on tensor cores: a row's bits whatever the batch, prefill or decode.

:func:`attention` follows :mod:`libalign.strict.tensorcore`'s rule (no reduction whose order
depends on the call's size):

* A program takes 64 or 128 (query head, query) rows of one key/value head
  (:func:`attention_config`), so a decode step's grouped heads read the keys once; keys,
  values and the output tile move by TMA, so no per-element address sits in registers.
* The keys are walked in blocks of 64 with an online softmax, the blocks counted from the
  sequence's **first visible key**, not from slot 0. A prompt left-padded in a sampler's KV
  cache and the same prompt right-padded in a learner's batch therefore meet the same keys in
  the same blocks; blocks a query cannot see change nothing (``m`` stays, ``alpha = 1``,
  ``p = 0``).
* The keys a row sees are cut into chunks of 256 from that same key, each chunk's softmax
  started fresh, and the chunks folded in order by explicit fused multiply-adds. A decode step
  (few rows) gives each chunk its own program and folds them in a second kernel; a prefill
  walks its rows' chunks in one program. The fold is the same code in both, so a row gets the
  same bits either way.
* :func:`visible_range` finds each row's first and last visible key in one launch; rows that
  see one interval (causal, padded) need no mask reads, and a tile with holes reads the mask
  as packed bits.
"""

from __future__ import annotations

import math
import numbers

import torch

from libalign.errors import DTypeError, InputError, ShapeError
from libalign.kernels.grid import cdiv, next_power_of_2
from libalign.strict.tensorcore import require

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

__all__ = ["ATTENTION_CONFIG", "ATTENTION_CONFIG_LARGE", "attention", "attention_config",
           "visible_range"]

_ATT_BLOCK = 64  # keys per step
#: :func:`visible_range`'s program: mask elements it reads at once (rows of ``Tk`` keys, a power
#: of two of them) and warps.
VISIBLE_TILE = (2048, 4)
#: On a GPU of compute capability 9.0 or later, launch the attention kernel as a programmatic
#: dependent of :func:`visible_range`'s: its programs start (load their queries) while the
#: mask analysis finishes, and wait for it (``griddepcontrol.wait``) before reading it. Only
#: the start moves: the arithmetic and the bits are the same either way.
DEPENDENT_LAUNCH = True
#: A prefill whose query tiles hold whole heads' queries launches the tiles of each head's
#: last queries first: under a causal mask they see the most keys, so the longest programs
#: start first and the short ones fill the end. Only the launch order changes.
LATE_FIRST = True


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when a TMA descriptor can address it (16-byte aligned base, unit last
    stride, every other stride a multiple of 16 bytes), else a contiguous copy."""
    size = x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
            (st * size) % 16 == 0 for st in x.stride()[:-1]):
        return x
    return x.contiguous()


if triton is not None:

    @triton.jit
    def _visible_kernel(mask_ptr, first_ptr, hi_ptr, count_ptr, bits_ptr, R, Tk, W, HM, Tq,
                        s_mb, s_mh, s_mt, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                        DEPENDENTS: tl.constexpr):
        # program p: mask rows p * ROWS .. + ROWS (row r is (sequence, head, query) of the
        # [B, HM, Tq, Tk] mask, read through its strides: a broadcast mask is not copied);
        # for each, its first visible key (Tk when none), last visible key + 1 (0 when none),
        # number of visible keys, all exact whatever the chunking, and the row packed 64 keys
        # a word (key j is bit j % 64 of word j // 64; W - 1 words, then a zero word that a
        # block straddling the row's end reads)
        # a dependent launch (the attention kernel) may start once every program got here;
        # it waits for this kernel's end before it reads what this one writes
        if DEPENDENTS:
            gdc_launch_dependents()
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        r_ok = r < R
        row_at = (r // (HM * Tq)) * s_mb + ((r // Tq) % HM) * s_mh + (r % Tq) * s_mt
        first = tl.zeros((ROWS,), tl.int32) + Tk
        hi = tl.zeros((ROWS,), tl.int32)
        count = tl.zeros((ROWS,), tl.int32)
        bit = tl.arange(0, 64).to(tl.int64)
        for start in range(0, Tk, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            seen = tl.load(mask_ptr + row_at[:, None] + offs[None, :],
                           mask=r_ok[:, None] & (offs[None, :] < Tk), other=0) != 0
            first = tl.minimum(first, tl.min(tl.where(seen, offs[None, :], Tk), 1))
            hi = tl.maximum(hi, tl.max(tl.where(seen, offs[None, :] + 1, 0), 1))
            count += tl.sum(seen.to(tl.int32), 1)
            words = tl.sum(tl.reshape(seen.to(tl.int64), (ROWS, BLOCK // 64, 64))
                           << bit[None, None, :], 2)
            w = start // 64 + tl.arange(0, BLOCK // 64)
            tl.store(bits_ptr + r[:, None] * W + w[None, :], words,
                     mask=r_ok[:, None] & (w[None, :] < W - 1))
        tl.store(bits_ptr + r * W + W - 1, tl.zeros((ROWS,), tl.int64), mask=r_ok)
        tl.store(first_ptr + r, first, mask=r_ok)
        tl.store(hi_ptr + r, hi, mask=r_ok)
        tl.store(count_ptr + r, count, mask=r_ok)

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
        bits of the rows, words ``brow``), then ``m``, ``l`` and the output rescaled.
        ``scaling`` is the softmax scale times log2(e): ``m`` is kept in base-2 units, and a
        probability is ``2 ** fma(score, scaling, -m)``, one fused step from the raw product
        (the scale's multiply, the shift and the exponential's change of base in one)."""
        offs_k = start + tl.arange(0, BLOCK)
        k = tl.reshape(k_desc.load([b, hk, start, 0]), (BLOCK, D))  # zeros past Tk
        s = tl.dot(q, tl.trans(k))
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
        m_new = tl.maximum(m_i, tl.max(s, 1) * scaling)  # the scale is positive: max commutes
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(tl.fma(s, scaling, -shift[:, None]))
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
        multiply-adds (so every kernel that folds rounds alike). Maxima are in base-2 units
        (:func:`_key_block`). From (-inf, 0, 0) the first chunk's state comes out exactly."""
        new = tl.maximum(top, m_c)
        shift = tl.where(new == -float("inf"), 0.0, new)
        keep = tl.exp2(top - shift)
        take = tl.exp2(m_c - shift)
        total_n = tl.fma(l_c, take, total * keep)
        out_n = tl.fma(acc_c, take[:, None], out * keep[:, None])
        return (tl.where(use, new, top), tl.where(use, total_n, total),
                tl.where(use[:, None], out_n, out))

    @triton.jit
    def _chunks_walked(q, k_desc, v_desc, b, hk, base, stop, scaling, lo_r, his, brow, chunks,
                       D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr,
                       CHUNK: tl.constexpr, MASKED: tl.constexpr):
        """Every key block from ``base`` to ``stop`` in one loop (one software pipeline of
        key loads across chunk boundaries), each chunk's state folded in when its last block
        is done and then started fresh: the arithmetic of a loop per chunk, in the same
        order. Returns the rows' folded sums and outputs."""
        top = tl.full((BLOCK_Q,), -float("inf"), tl.float32)
        total = tl.zeros((BLOCK_Q,), tl.float32)
        out = tl.zeros((BLOCK_Q, D), tl.float32)
        m_i = tl.full((BLOCK_Q,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, D), tl.float32)
        n_blocks = tl.maximum(stop - base + BLOCK - 1, 0) // BLOCK
        for j in range(0, n_blocks):
            # a chunk's first block starts from the fresh state (selected, not branched to:
            # the accumulator stays in the tensor-core pipeline)
            fresh = j % (CHUNK // BLOCK) == 0
            m_i = tl.where(fresh, -float("inf"), m_i)
            l_i = tl.where(fresh, 0.0, l_i)
            acc = tl.where(fresh, 0.0, acc)
            m_i, l_i, acc = _key_block(q, k_desc, v_desc, b, hk, base + j * BLOCK, scaling, lo_r,
                                       his, brow, m_i, l_i, acc, D, BLOCK, MASKED)
            if ((j + 1) % (CHUNK // BLOCK) == 0) | (j == n_blocks - 1):
                top, total, out = _fold(top, total, out, m_i, l_i, acc, j // (CHUNK // BLOCK)
                                        < chunks)
        return total, out

    @triton.jit
    def _normalised(out, total):
        """Rows' outputs over their softmax sums (zeros for a row that saw no key)."""
        return tl.where(total[:, None] > 0, out / tl.where(total > 0, total, 1.0)[:, None], 0.0)

    @triton.jit
    def _store_tile(o_desc, bk, pid_v, out, total, D: tl.constexpr, BLOCK_Q: tl.constexpr):
        """A program's rows, normalised and rounded, into the output by TMA."""
        o_desc.store([bk, pid_v * BLOCK_Q, 0],
                     tl.reshape(_normalised(out, total).to(o_desc.dtype), (1, BLOCK_Q, D)))

    @triton.jit
    def _attention_kernel(q_ptr, k_desc, v_desc, o_desc, bits_ptr, first_ptr, hi_ptr, count_ptr,
                          Tq, Tk, HKV, REP, HM, scaling, W, s_qb, s_qh, s_qt,
                          ws_m_ptr, ws_l_ptr, ws_desc, R, HQ,
                          D: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK_Q: tl.constexpr, SERIAL: tl.constexpr,
                          LATE_FIRST: tl.constexpr, DEPENDENT: tl.constexpr):
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
        if LATE_FIRST:
            # launch order -> tile: the tiles of each head's last queries first, those of its
            # first queries last. Under a causal mask a late query sees the most keys, so the
            # longest programs start first and the short ones fill the end of the launch. Only
            # the order changes: each tile is still one program's, computed the same way.
            # (REP * Tq rows in whole tiles of BLOCK_Q: tq_tiles tiles a head.)
            tq_tiles = Tq // BLOCK_Q
            lin = pid_v + bk * tl.num_programs(0)
            groups = tl.num_programs(1) * REP  # (sequence, key/value head, query head)
            g = lin % groups
            bk = g // REP
            pid_v = (g % REP) * tq_tiles + (tq_tiles - 1 - lin // groups)
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
        if DEPENDENT:  # launched as visible_range's dependent: its results after its end
            gdc_wait()
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
            _store_tile(o_desc, bk, pid_v, acc, l_i, D, BLOCK_Q)
        elif SERIAL:
            chunks = _chunk_count(his, base, CHUNK)
            if all_span:
                total, out = _chunks_walked(q, k_desc, v_desc, b, hk, base, stop, scaling,
                                                 lo_r, his, brow, chunks, D, BLOCK, BLOCK_Q,
                                                 CHUNK, False)
            else:
                total, out = _chunks_walked(q, k_desc, v_desc, b, hk, base, stop, scaling,
                                                 lo_r, his, brow, chunks, D, BLOCK, BLOCK_Q,
                                                 CHUNK, True)
            _store_tile(o_desc, bk, pid_v, out, total, D, BLOCK_Q)
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
                _store_tile(o_desc, bk, pid_v, acc, l_i, D, BLOCK_Q)
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
        tl.store(o_ptr + b * s_ob + h[:, None] * s_oh + t[:, None] * s_ot + offs_d[None, :],
                 _normalised(out, total).to(o_ptr.dtype.element_ty), mask=mine[:, None])


#: Attention's (warps, pipeline stages, key chunk, query rows per program, chunks walked by
#: one program) for calls of at most 64 (query head, query) rows per key/value head (a decode
#: step). The key chunk (a multiple of 64, or 0) splits the keys a row sees into chunks of
#: that many from its sequence's first visible key, each chunk's softmax started fresh and the
#: chunks folded in order; it is part of a row's bits, so every setting shares it. A decode
#: step runs each chunk on its own program (many programs for a long cache). Keys are always
#: walked in blocks of 64.
ATTENTION_CONFIG = (4, 3, 256, 64, False)
#: The same for larger calls (a prefill): 64 query rows a program on 4 warps with a two-stage
#: key pipeline (two programs share a multiprocessor), each program walking its rows' chunks
#: itself (no partial results written). Tiles of 64 and 128 rows, on 4 or 8 warps, and either
#: way of running the chunks give a row the same bits (the tensor-core instruction and the
#: fold are the same; checked on a GPU, and decode against prefill in the tests).
ATTENTION_CONFIG_LARGE = (4, 2, 256, 64, True)


def attention_config(rows: int) -> tuple[int, int, int, int, bool]:
    """The attention setting of a call with ``rows`` (query head, query) rows per key/value
    head: :data:`ATTENTION_CONFIG` up to 64, else :data:`ATTENTION_CONFIG_LARGE`."""
    return ATTENTION_CONFIG if rows <= 64 else ATTENTION_CONFIG_LARGE


def _key_descriptor(x: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of keys or values ``[B, Hkv, Tk, D]`` whose box is one block of
    :data:`_ATT_BLOCK` keys of one sequence and head (reads past ``Tk`` give zeros)."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, _ATT_BLOCK, x.shape[-1]])


def visible_range(allowed: torch.Tensor, *, dependents: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's first visible key (``Tk`` when none), last visible key + 1 (0 when none) and
    number of visible keys, of a boolean mask ``[B, Hm, Tq, Tk]``: int32 ``[B, Hm, Tq]`` each;
    and the mask packed 64 keys a word, int64 ``[B * Hm * Tq, ceil(Tk / 64) + 1]`` (key ``j``
    is bit ``j % 64`` of word ``j // 64``; the last word is zero). One launch, a program
    taking :data:`VISIBLE_TILE` mask elements' worth of rows. A row whose count is
    ``hi - first`` sees one interval of keys. ``dependents``: the next launch on the stream
    is a programmatic dependent (:data:`DEPENDENT_LAUNCH`), released as soon as every program
    has started."""
    b, hm, tq, tk = allowed.shape
    n = b * hm * tq
    if allowed.stride(-1) != 1:
        allowed = allowed.contiguous()
    first = torch.empty((b, hm, tq), dtype=torch.int32, device=allowed.device)
    hi, count = torch.empty_like(first), torch.empty_like(first)
    bits = torch.empty((n, cdiv(tk, 64) + 1), dtype=torch.int64, device=allowed.device)
    if first.numel() and tk:
        block = max(64, min(1024, next_power_of_2(tk)))
        per = max(1, min(next_power_of_2(n), VISIBLE_TILE[0] // block))
        _visible_kernel[(cdiv(n, per),)](allowed.view(torch.uint8), first, hi, count, bits, n,
                                         tk, bits.shape[1], hm, tq, *allowed.stride()[:3],
                                         ROWS=per, BLOCK=block, DEPENDENTS=dependents,
                                         num_warps=VISIBLE_TILE[1])
    elif first.numel():
        for t in (first, hi, count, bits):
            t.fill_(0)
    return first, hi, count, bits


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              scaling: float, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """Masked softmax attention ``[B, Hq, Tq, D]`` (grouped-query: ``Hq`` a multiple of ``Hkv``):
    ``q`` ``[B, Hq, Tq, D]``, ``k``, ``v`` ``[B, Hkv, Tk, D]`` (bf16 or fp16), ``allowed``
    ``[B, 1|Hq, Tq, Tk]`` (True = attend). Keys in blocks of 64 from each sequence's first
    visible key; a query that sees no key gets zeros. A program takes 64 or 128 (query head,
    query) rows of one key/value head (:func:`attention_config`), so a decode step's grouped
    heads read the keys once. ``config`` (warps, stages, key chunk, query rows[, chunks walked
    by one program]) overrides that choice (a probe; the key chunk is part of the rows'
    bits; without the fifth entry the chunks run as :func:`attention_config` says)."""
    if not (isinstance(scaling, numbers.Real) and math.isfinite(scaling) and scaling > 0):
        raise InputError(f"strict attention: softmax scale {scaling!r} (a positive finite number: "
                         "the kernel keeps scores in base-2 units, scale folded in)")
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
    nc = max(1, cdiv(tk, chunk)) if chunk else 1
    serial = serial[0] if serial else attention_config(rows)[4]
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
    scan = min(1024, next_power_of_2(hm * tq))
    base2_scale = float(scaling) * math.log2(math.e)  # scores in base-2 units (_key_block)
    # the dependent launch where the device has it (a CPU tensor runs Triton's interpreter)
    dependent = DEPENDENT_LAUNCH and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
    with torch.cuda.device(q.device):
        first, hi, count, bits = visible_range(allowed, dependents=dependent)
        _attention_kernel[(cdiv(rows, block_q), b * hkv, nc if split else 1)](
            qc, _key_descriptor(kc), _key_descriptor(vc), o_desc, bits, first, hi, count, tq, tk,
            hkv, rep, hm, base2_scale, bits.shape[1], *qc.stride()[:3], ws_m, ws_l, ws_desc,
            b * hq * tq, hq, D=d, BLOCK=_ATT_BLOCK, SCAN=scan, CHUNK=chunk if nc > 1 else 0,
            BLOCK_Q=block_q, SERIAL=serial, LATE_FIRST=LATE_FIRST and not split
            and tq % block_q == 0 and tq > block_q, DEPENDENT=dependent, launch_pdl=dependent,
            num_warps=warps, num_stages=stages)
        if split:
            _combine_kernel[(cdiv(hq * tq, 16), b)](
                out, first, hi, ws_m, ws_l, ws_acc, tq, tk, hq, hm, nc, b * hq * tq,
                *out.stride()[:3], D=d, ROWS=16, SCAN=scan, CHUNK=chunk, num_warps=4)
    return out
