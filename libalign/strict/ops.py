"""Batch-invariant operations: one result per row, whatever else is in the call.

Why a learner and a sampler disagree on the same weights
--------------------------------------------------------
A sampler decodes one token at a time through a KV cache; a learner scores a whole sequence
in one pass. Both ask every operation for the same mathematical value, but the *floating-point*
value of a sum depends on the order of its additions, and a stock kernel picks that order from
the shape of the call: a GEMM blocks and splits K differently for 8 rows than for 800, a
reduction splits over threads when its output is small, a vectorized ``exp`` computes the
elements of a vector register with SLEEF and the leftover tail with the C library. The same
row then comes out a few ulps apart depending on how many other rows shared the call, and
log-probabilities drift (miniTE's "execution gap", on BF16 already).

The rule this module follows
----------------------------
Every operation here computes each output element with **element-wise IEEE operations only**
(``+ - * /``, ``sqrt``, comparisons, bit manipulation), in an order written down below, so the
value of an output element depends on its own inputs and nothing else: not on the batch size,
the sequence length, the thread count, the vector width or the device. IEEE 754 rounds each of
those operations correctly, so the CPU's vector lanes, its scalar tail and a CUDA thread all
produce the same bits for the same inputs.

* **Sums** over a fixed-length axis (a hidden dimension, a head dimension, the vocabulary, the
  experts) are a pairwise tree: pad to a power of two with zeros, add the upper half to the
  lower half until one element is left (:func:`tree_sum`). Zeros padded at the end never change
  a tree's value, so the tree is also independent of how far it was padded.
* **Matrix products** accumulate in fp32 in K order, ``acc = ((a0 w0 + a1 w1) + a2 w2) + ...``
  (:func:`linear`): a rank-1 update of the whole output per k, so every row follows the same
  sequence of roundings. With bf16 (or NVFP4 inner) operands every product is exact in fp32,
  and the result is rounded once to the output dtype.
* **Sums over keys** in attention run in *slot order* (:func:`attention`): a masked slot adds an
  exact zero, so a prompt left-padded in a KV cache and the same prompt right-padded in a
  scoring batch add the same terms in the same order.
* **exp** and **log** are written here (:func:`exp`, :func:`log`) as range reduction plus a
  fixed polynomial (about one ulp from the true value), because the libraries' versions differ
  between vector lanes and scalar code.
* **Top-k** breaks ties toward the lower index (:func:`topk_indices`); a maximum is exact in
  any order.

The price is speed (a K-step loop of element-wise passes instead of one GEMM call; see
``python -m tests.bench strict``); strictness is an execution mode one selects
(:mod:`libalign.models.strict`), and the default paths keep their kernels.

Gradients
---------
Training needs only the *forward* values to match the sampler's; the backward may take any
order. :func:`linear` and :func:`attention` therefore run their strict forward under
``no_grad`` and differentiate the stock formula in backward; the other operations are built
from differentiable element-wise pieces (``exp`` and ``log`` have their own derivatives).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from libalign.errors import DTypeError, ShapeError
from libalign.strict.triton_matmul import kordered_matmul, kordered_matmul_available

__all__ = ["attention", "attention_stock", "check_linear", "check_topk", "combine_experts", "exp",
           "linear", "log", "log_softmax", "rms_norm", "sequential_sum", "silu", "softmax",
           "topk_indices", "tree_sum"]

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125       # 0.6931457519 has 15 significant bits: n * _LN2_HI is exact
_LN2_LO = 1.4286067653302226e-06  # ln 2 - _LN2_HI
_SQRT2 = 1.4142135623730951


def _f32(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise DTypeError(f"strict ops take floating-point tensors, got {x.dtype}")
    return x.float()


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """``2**n`` for integer-valued fp32 ``n`` in [-126, 127], built from its exponent bits."""
    return torch.bitwise_left_shift(n.to(torch.int32) + 127, 23).view(torch.float32)


def _exp_values(x: torch.Tensor) -> torch.Tensor:
    # exp(x) = 2**n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (Cody-Waite
    # with a two-part ln 2), exp(r) by its degree-7 Taylor polynomial in Horner form (error
    # below 0.1 ulp), 2**n applied in two exact halves so that subnormal results stay right.
    xc = x.clamp(-104.0, 89.0)
    n = torch.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = r * (1.0 / 5040) + (1.0 / 720)
    for c in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * r + c
    n1 = torch.floor(n * 0.5)
    y = (p * _pow2(n1)) * _pow2(n - n1)
    y = torch.where(x > 88.72283935546875, torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x), x, y)


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = _exp_values(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e**x`` in fp32, the same bits for an element wherever it sits (about 1 ulp of exact)."""
    return _Exp.apply(_f32(x))


def _log_values(x: torch.Tensor) -> torch.Tensor:
    # x = m * 2**e with m in [sqrt(1/2), sqrt(2)); log m = 2 atanh(s), s = (m - 1) / (m + 1),
    # |s| < 0.172, by the odd series to s**15; log x = e ln2 + log m (two-part ln 2).
    tiny = x < 1.1754943508222875e-38
    xs = torch.where(tiny, x * 16777216.0, x)  # subnormals: scale by 2**24 first
    bits = xs.view(torch.int32)
    e = (torch.bitwise_right_shift(bits, 23) & 0xFF) - 127 - torch.where(tiny, 24, 0)
    m = (torch.bitwise_and(bits, 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    ef = (e + big.to(torch.int32)).to(torch.float32)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    q = z * (2.0 / 15) + (2.0 / 13)
    for c in (2.0 / 11, 2.0 / 9, 2.0 / 7, 2.0 / 5, 2.0 / 3):
        q = q * z + c
    logm = s * 2.0 + (s * z) * q
    y = ef * _LN2_HI + (logm + ef * _LN2_LO)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x == math.inf, x, y)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(y, math.nan), y)


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _log_values(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / x


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in fp32, position-independent like :func:`exp` (about 1 ulp of exact)."""
    return _Log.apply(_f32(x))


# --- reductions -------------------------------------------------------------------------------

def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` as a pairwise tree (zero-padded to a power of two), in ``x``'s dtype."""
    x = x.movedim(dim, 0)
    n = x.shape[0]
    if n == 0:
        out = x.new_zeros(x.shape[1:])
    else:
        width = 1 << (n - 1).bit_length()
        if width != n:
            x = torch.cat([x, x.new_zeros((width - n, *x.shape[1:]))])
        while width > 1:
            width //= 2
            x = x[:width] + x[width:]
        out = x[0]
    return out.unsqueeze(dim if dim >= 0 else out.ndim + 1 + dim) if keepdim else out


def sequential_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` left to right (``((x0 + x1) + x2) + ...``), in ``x``'s dtype."""
    x = x.movedim(dim, 0)
    out = x.new_zeros(x.shape[1:])
    for i in range(x.shape[0]):
        out = out + x[i]
    return out.unsqueeze(dim if dim >= 0 else out.ndim + 1 + dim) if keepdim else out


def combine_experts(y: torch.Tensor, slot_of: torch.Tensor, weights: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """A MoE layer's output: each token's ``k`` expert rows (``y`` ``[T * k, H]`` sorted by
    expert, ``slot_of[t * k + j]`` the sorted row of token ``t``'s slot ``j``) times its router
    weight rounded to ``y``'s dtype, in ``y``'s dtype, then added in fp32 in slot order from
    0 (:func:`sequential_sum`) and rounded once to ``out_dtype``; differentiable."""
    t, k = weights.shape
    rows = y[slot_of] * weights.reshape(-1, 1).to(y.dtype)
    return sequential_sum(rows.reshape(t, k, -1).float(), 1).to(out_dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dimension: ``exp(x - max) / tree_sum``."""
    xf = _f32(x)
    e = exp(xf - xf.detach().amax(-1, keepdim=True))
    return e / tree_sum(e, -1, keepdim=True)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dimension: ``x - max - log(tree_sum(exp(x - max)))``."""
    xf = _f32(x)
    z = xf - xf.detach().amax(-1, keepdim=True)
    return z - log(tree_sum(exp(z), -1, keepdim=True))


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` computed in fp32, returned in ``x``'s dtype."""
    xf = _f32(x)
    return (xf / (exp(-xf) + 1.0)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Qwen3 defines it: ``weight * (x / sqrt(mean(x**2) + eps))`` with the mean a
    tree sum in fp32 divided by the width, the product rounded to ``x``'s dtype first."""
    xf = _f32(x)
    var = tree_sum(xf * xf, -1, keepdim=True) / x.shape[-1]
    y = (xf * (1.0 / torch.sqrt(var + eps))).to(x.dtype)
    return weight * y


def check_topk(k: int, n: int) -> None:
    """:class:`~libalign.errors.ShapeError` unless ``1 <= k <= n`` (top-``k`` of ``n``)."""
    if not 1 <= k <= n:
        raise ShapeError(f"top-{k} of {n} entries")


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row, largest first, ties to the lower index."""
    s = scores.detach().clone()
    n = s.shape[-1]
    check_topk(k, n)
    pos = torch.arange(n, device=s.device).expand_as(s)
    out = []
    for _ in range(k):
        m = s.amax(-1, keepdim=True)
        idx = torch.where(s == m, pos, n).amin(-1, keepdim=True)
        out.append(idx)
        s = s.scatter(-1, idx, -math.inf)
    return torch.cat(out, -1)


# --- products ---------------------------------------------------------------------------------

def matmul_f32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` in fp32 accumulated in K order (no autograd): ``a`` ``[M, K]``, ``w`` ``[N, K]``.

    One rank-1 update of the whole ``[M, N]`` accumulator per k: every output element sees the
    additions in the same order whatever M is. On a GPU one Triton kernel computes the same
    roundings in registers (:mod:`libalign.strict.triton_matmul`): the same bits, without 2K launches.
    """
    if a.ndim != 2 or w.ndim != 2 or a.shape[1] != w.shape[1]:
        raise ShapeError(f"matmul_f32 needs [M, K] x [N, K], got {tuple(a.shape)} and "
                         f"{tuple(w.shape)}")
    if kordered_matmul_available(a):
        return kordered_matmul(a.detach(), w.detach())
    at = a.detach().float().t().contiguous()
    wt = w.detach().float().t().contiguous()
    m, n = a.shape[0], w.shape[0]
    if at.shape[0] == 0:
        return at.new_zeros((m, n))
    acc = at[0].unsqueeze(1) * wt[0]
    tmp = torch.empty_like(acc)
    for k in range(1, at.shape[0]):
        torch.mul(at[k].unsqueeze(1), wt[k], out=tmp)
        acc.add_(tmp)
    return acc


class _StrictForward(torch.autograd.Function):
    """Forward: the strict function (no autograd); backward: the gradient of the stock one."""

    @staticmethod
    def forward(ctx, strict_fn, stock_fn, *inputs):
        ctx.stock_fn = stock_fn
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return strict_fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        inputs = ctx.saved_tensors
        want = [i for i, x in enumerate(inputs) if ctx.needs_input_grad[i + 2]]
        if not want:
            return (None, None, *([None] * len(inputs)))
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(i in want) for i, x in enumerate(inputs)]
            out = ctx.stock_fn(*xs)
            got = torch.autograd.grad(out, [xs[i] for i in want], grad, allow_unused=True)
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        for i, g in zip(want, got, strict=True):
            grads[i] = g
        return (None, None, *grads)


def strict_forward(strict_fn: Callable, stock_fn: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    """``strict_fn(*inputs)`` whose backward is the gradient of ``stock_fn`` (same math)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return _StrictForward.apply(strict_fn, stock_fn, *inputs)
    with torch.no_grad():
        return strict_fn(*inputs)


def _linear_values(x, weight, bias=None):
    k = x.shape[-1]
    acc = matmul_f32(x.reshape(-1, k), weight)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def check_linear(x: torch.Tensor, weight: torch.Tensor) -> None:
    """:class:`~libalign.errors.ShapeError` unless ``x``'s width is ``weight``'s ``[N, K]`` K."""
    if x.shape[-1] != weight.shape[-1]:
        raise ShapeError(f"linear: input width {x.shape[-1]}, weight {tuple(weight.shape)}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with the K-ordered fp32 accumulation, rounded once to ``x``'s
    dtype; differentiable (the backward is ``torch.nn.functional.linear``'s)."""
    check_linear(x, weight)
    if bias is None:
        return strict_forward(_linear_values, torch.nn.functional.linear, x, weight)
    return strict_forward(_linear_values, torch.nn.functional.linear, x, weight, bias)


# --- attention --------------------------------------------------------------------------------

def _attention_values(q, k, v, allowed, scaling):
    # q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D]; allowed [B, 1 or Hq, Tq, Tk] (bool).
    b, hq, tq, d = q.shape
    rep = hq // k.shape[1]
    qf = q.float().reshape(b, k.shape[1], rep, tq, d)
    kf = k.float().unsqueeze(2)
    vf = v.float().unsqueeze(2)
    # scores: per (query, key) a tree sum over the head dimension
    prod = qf.unsqueeze(-2) * kf.unsqueeze(-3)                 # [B, Hkv, rep, Tq, Tk, D]
    s = tree_sum(prod, -1) * scaling                            # [B, Hkv, rep, Tq, Tk]
    ok = allowed.reshape(b, -1, 1, tq, allowed.shape[-1]) if allowed.shape[1] == 1 else \
        allowed.reshape(b, k.shape[1], rep, tq, allowed.shape[-1])
    ok = ok.expand_as(s)
    s = torch.where(ok, s, -math.inf)
    m = s.amax(-1, keepdim=True)
    live = torch.isfinite(m)
    e = torch.where(ok & live, _exp_values(s - torch.where(live, m, 0.0)), 0.0)
    # keys in slot order: a masked slot adds an exact zero wherever it sits
    den, num = _slot_sums(e, vf)
    out = torch.where(den.unsqueeze(-1) > 0, num / den.clamp_min(1e-38).unsqueeze(-1), 0.0)
    return out.reshape(b, hq, tq, d).to(q.dtype)


def _slot_sums(e, vf):
    """``sum_j e[..., j]`` and ``sum_j e[..., j] v[j]`` from +0 in slot order: ``e`` ``[B, Hkv,
    rep, Tq, Tk]``, ``vf`` ``[B, Hkv, 1, Tk, D]`` (fp32)."""
    if kordered_matmul_available(e):
        b, hkv, rep, tq, tk = e.shape
        a = e.reshape(b * hkv, rep * tq, tk)
        # one pass over e: a column of ones beside V's columns sums e itself (products e * 1
        # are exact), and every output column is its own sum in slot order
        v3 = vf.reshape(b * hkv, tk, -1).transpose(1, 2)
        ones = v3.new_ones((b * hkv, 1, tk))
        sums = kordered_matmul(a, torch.cat([v3, ones], 1), zero_init=True)
        sums = sums.reshape(b, hkv, rep, tq, -1)
        return sums[..., -1], sums[..., :-1]
    den = torch.zeros_like(e[..., 0])
    num = torch.zeros((*e.shape[:-1], vf.shape[-1]), dtype=torch.float32, device=e.device)
    for j in range(e.shape[-1]):
        den = den + e[..., j]
        num = num + e[..., j].unsqueeze(-1) * vf[:, :, :, j].unsqueeze(-2)
    return den, num


def attention_stock(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """The stock (not batch-invariant) masked attention whose gradient the strict attention
    backward uses; fp32 scores and probabilities, a query that sees no key gets zeros."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.matmul(p, v.float()).to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              scaling: float) -> torch.Tensor:
    """Masked softmax attention, ``[B, Hq, Tq, D]`` from ``q`` ``[B, Hq, Tq, D]`` and ``k``, ``v``
    ``[B, Hkv, Tk, D]`` (grouped-query: ``Hq`` a multiple of ``Hkv``); ``allowed`` ``[B, 1|Hq, Tq,
    Tk]`` says which keys each query sees. Scores and probabilities in fp32; a query that sees
    no key gets zeros. Differentiable (the backward is the stock formula's)."""
    if q.ndim != 4 or k.shape != v.shape or q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    fn = lambda q_, k_, v_: _attention_values(q_, k_, v_, allowed, scaling)  # noqa: E731
    stock = lambda q_, k_, v_: attention_stock(q_, k_, v_, allowed, scaling)  # noqa: E731
    return strict_forward(fn, stock, q, k, v)
