"""The executable numerical specification of NVFP4 and MXFP4: THE reference quantize/dequantize.

An NVFP4 tensor is three things: 4-bit E2M1 codes (two per byte, even element in the low
nibble), one E4M3 block scale per 16 consecutive elements of the last dimension, and an
FP32 outer scale whose domain is the whole tensor, one expert of a 3-D stack, or one row.
Reconstruction is ``x ~ e2m1(code) * e4m3(block scale) * outer decode scale``.

An MXFP4 tensor (OCP Microscaling) has the same codes, one E8M0 block scale (a power of
two) per 32 elements and no outer scale: ``x ~ e2m1(code) * 2^(byte - 127)``. One type,
:class:`NVFP4Tensor`, carries both (its ``block_scales`` dtype says which: float8_e4m3fn or
float8_e8m0fnu, and MXFP4's ``outer_scale`` is None), so packing, stores and guidance
records handle both alike; the spec's ``op_order`` picks the scale rule and
``block_size`` the block (16 or 32). Steps 3-5 below are NVFP4's; an MX spec computes its
E8M0 byte from the block maximum by its rule instead (:mod:`libalign.spec.scale_math`).

"Matching an FP4 encoding" leaves many bits open. :class:`NumericsSpec` names every choice
a bit depends on, and :func:`quantize` executes them in this order, in fp32 unless the
spec says otherwise:

1. refuse (or saturate) NaN/Inf; pad K to a multiple of the block (16, MXFP4 32) with
   zeros (or refuse);
2. optionally rotate each block with the fixed 16-point Hadamard transform;
3. block maxima ``v = max |x|`` per block, outer maximum ``A`` per outer domain, floored;
4. outer scales ``enc``/``dec`` from ``A`` in the spec's operation order
   (:mod:`libalign.spec.scale_math`);
5. the fp32 block scale, zero substitution, clamp to [floor, 448], explicit E4M3 RNE;
6. the element encoding in the same order, a zero-scale block's multiplier by policy,
   clamp to [-6, 6], E2M1 round-half-even (or stochastic) with the signed-zero policy;
7. nibble packing.

Kernels (CUDA, CPU) are tested against this module bit for bit; quality against BF16 is
a separate question. :class:`NumericsSpec` and the presets that reproduce public quantizers
(``minite``, ``te``, ``torchao``, ``modelopt``, ``compressed_tensors``, and the MXFP4
``mxfp4``, ``mxfp4_ceil``, ``mxfp4_even``, ``mxfp4_te``) are defined in
:mod:`libalign.spec.presets` and importable from here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from libalign.errors import DTypeError, NonFiniteError, ShapeError, SpecError, UndefinedScaleError
from libalign.spec import scale_math
from libalign.spec.constants import E2M1_MAX, FLT_MAX
from libalign.spec.four_over_six import encode_4over6, stored_outer
from libalign.spec.hadamard import rht16, rht16_inverse
from libalign.spec.packing import pack_nibbles, swizzle_scales, unpack_nibbles
from libalign.spec.presets import OUTER_CONVENTIONS, OUTER_DOMAINS, PRESETS, NumericsSpec
from libalign.spec.rounding import (
    block_scale_values,
    canonical_zero,
    e2m1_code_values,
    e4m3_bits_to_float,
    round_e2m1,
    round_e2m1_stochastic,
    round_e4m3_bits,
    saturate_e4m3,
)

__all__ = [
    "CHUNK_BLOCKS", "INPUT_DTYPES", "OUTER_CONVENTIONS", "OUTER_DOMAINS", "PRESETS", "NVFP4Tensor",
    "NumericsSpec", "check_finite", "check_input", "checked_outer_amax", "checked_outer_scale",
    "dequantize",
    "encode_with_scales", "normalized_with_scales", "quantize", "roundtrip_codes",
    "shared_outer_amax",
]

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """A quantized tensor: packed codes, linear block scales, outer scale, and its spec.

    Attributes:
        codes: uint8 ``[..., Kp/2]``, low nibble = even index (Kp = K padded to the block).
        block_scales: float8_e4m3fn ``[..., Kp/16]`` (NVFP4) or float8_e8m0fnu
            ``[..., Kp/32]`` (MXFP4), linear layout.
        outer_scale: fp32 in ``spec.outer_convention``; shape ``[]`` (tensor), ``[E]``
            (expert), ``[..., M]`` (row); ``None`` for outer domain ``none``.
        spec: the numerics spec that produced (or interprets) the bits.
        shape: logical shape of the original tensor (K unpadded).
        outer_amax: the floored fp32 outer maxima when quantized from data, else None.
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    outer_scale: torch.Tensor | None
    spec: NumericsSpec
    shape: tuple[int, ...]
    outer_amax: torch.Tensor | None = None

    @property
    def k(self) -> int:
        """Logical length of the last dimension."""
        return self.shape[-1]

    def outer(self) -> scale_math.OuterScales:
        """Outer scales in both conventions (exactly 1 for outer domain ``none``)."""
        if self.outer_scale is None:
            one = torch.ones((), dtype=torch.float32, device=self.codes.device)
            return scale_math.OuterScales(enc=one, dec=one)
        return scale_math.outer_from_stored(
            self.outer_scale, self.spec.outer_convention, self.spec.op_order,
            _math_dtype(self.spec, torch.float32), self.spec.e4m3_max,
        )

    @property
    def outer_enc(self) -> torch.Tensor:
        """Outer encode scale (about 2688 / amax)."""
        return self.outer().enc

    @property
    def outer_dec(self) -> torch.Tensor:
        """Outer decode scale (about amax / 2688); the stored tensor itself when the spec
        stores decode scales (nothing computed, nothing launched)."""
        if self.outer_scale is not None and self.spec.outer_convention == "dec":
            return self.outer_scale.to(torch.float32)
        return self.outer().dec

    def swizzled_block_scales(self) -> torch.Tensor:
        """Block scales in the 128x4 swizzled layout (flat, zero padded)."""
        return swizzle_scales(self.block_scales)

    def dequantize(self, dtype: torch.dtype = torch.float32, *, rotated: bool = False):
        """See :func:`dequantize`."""
        return dequantize(self, dtype, rotated=rotated)

    def expert(self, e: int) -> NVFP4Tensor:
        """Expert ``e`` of a 3-D stack as a 2-D tensor with its own outer scale."""
        if len(self.shape) != 3:
            raise ShapeError(f"expert() needs a 3-D stack, this tensor has shape {self.shape}")
        dom = self.spec.outer_domain
        outer = self.outer_scale
        if outer is not None and dom in ("expert", "row"):
            outer = outer[e]
        amax = self.outer_amax
        if amax is not None and dom in ("expert", "row"):
            amax = amax[e]
        spec = self.spec.replace(outer_domain="tensor") if dom == "expert" else self.spec
        return NVFP4Tensor(self.codes[e], self.block_scales[e], outer, spec,
                           tuple(self.shape[1:]), amax)

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        """The same bits on another device."""
        def move(t):
            return None if t is None else t.to(device)

        return NVFP4Tensor(self.codes.to(device), self.block_scales.to(device),
                           move(self.outer_scale), self.spec, self.shape, move(self.outer_amax))

    def payload_sha256(self) -> str:
        """SHA-256 of the packed codes."""
        return _sha256(self.codes)

    def scales_sha256(self) -> str:
        """SHA-256 of the block-scale bytes."""
        return _sha256(self.block_scales.view(torch.uint8))

    def bitwise_equal(self, other: NVFP4Tensor) -> bool:
        """Codes, block-scale bytes and outer-scale bits all identical."""
        if self.shape != other.shape or not torch.equal(self.codes, other.codes):
            return False
        if not torch.equal(self.block_scales.view(torch.uint8), other.block_scales.view(torch.uint8)):
            return False
        if (self.outer_scale is None) != (other.outer_scale is None):
            return False
        return self.outer_scale is None or torch.equal(
            self.outer_scale.view(torch.int32), other.outer_scale.view(torch.int32)
        )

    @property
    def nbytes(self) -> int:
        """Bytes of codes, block scales and outer scale."""
        n = self.codes.numel() + self.block_scales.numel()
        return n + (0 if self.outer_scale is None else 4 * self.outer_scale.numel())


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def _math_dtype(spec: NumericsSpec, input_dtype: torch.dtype) -> torch.dtype:
    return input_dtype if spec.scale_math_dtype == "input" else torch.float32


def check_input(x: Any, spec: NumericsSpec) -> None:
    """Refuse what no quantizer accepts: a non-tensor, a dtype other than fp32/bf16/fp16, a
    rank other than 2 or 3, or K not a multiple of 16 under a spec that refuses to pad.

    Raises :class:`DTypeError` or :class:`ShapeError`; every quantize path (the spec, the
    kernels, guided rounding) checks its input here first, so all refuse alike.
    """
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise DTypeError(f"quantize accepts float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim not in (2, 3):
        raise ShapeError(
            f"quantize expects a 2-D matrix [M, K] or a 3-D expert stack [E, M, K], "
            f"got {x.ndim}-D shape {tuple(x.shape)}"
        )
    if spec.k_remainder == "refuse" and x.shape[-1] % spec.block_size:
        raise ShapeError(
            f"K={x.shape[-1]} is not a multiple of {spec.block_size} and preset {spec.name!r} "
            f"refuses to pad"
        )


def check_finite(x: torch.Tensor, what: str = "input", limit: int = 5) -> None:
    """Raise :class:`NonFiniteError` naming how many NaN/Inf and the first positions."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        nan = int(torch.isnan(x).sum())
        count = int(bad.sum())
        first = torch.nonzero(bad)[:limit].tolist()
        raise NonFiniteError(what, count, nan, count - nan, [tuple(ix) for ix in first])


def _saturate_nonfinite(x: torch.Tensor) -> torch.Tensor:
    big = torch.finfo(x.dtype).max
    return torch.nan_to_num(x, nan=0.0, posinf=big, neginf=-big)


def _amax(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Max over ``dims`` that returns 0 for empty reductions."""
    if t.numel() == 0:
        keep = [s for i, s in enumerate(t.shape) if i not in {d % t.ndim for d in dims}]
        return t.new_zeros(keep)
    return torch.amax(t, dim=dims) if dims else t


def _outer_amax(vmax: torch.Tensor, domain: str) -> torch.Tensor:
    """Outer maxima from block maxima ``[..., M, nb]``: [], [E] or [..., M]."""
    if domain == "tensor" or (domain == "expert" and vmax.ndim == 2):
        return _amax(vmax, tuple(range(vmax.ndim)))
    if domain == "expert":
        return _amax(vmax, (-2, -1))
    return _amax(vmax, (-1,))  # row


def _broadcast_outer(t: torch.Tensor, domain: str, vmax_ndim: int) -> torch.Tensor:
    """Shape an outer-domain tensor to broadcast against block maxima ``[..., M, nb]``."""
    if t.ndim == 0:
        return t
    if domain == "expert":
        return t.reshape(-1, *([1] * (vmax_ndim - 1)))
    return t.unsqueeze(-1)  # row


#: Blocks encoded per chunk: every step after the block scales is elementwise per block,
#: so working through cache-sized chunks gives the same bits as one pass, faster.
CHUNK_BLOCKS = 1 << 15


def _prepared_blocks(x: torch.Tensor, spec: NumericsSpec) -> torch.Tensor:
    """Steps 1-2: refuse or saturate NaN/Inf, fp32, zero-pad K, optional rotation, blocks."""
    if spec.nonfinite == "raise":
        check_finite(x)
    else:
        x = _saturate_nonfinite(x)
    x32 = x.to(torch.float32)
    pad = -x.shape[-1] % spec.block_size
    if pad:
        x32 = torch.nn.functional.pad(x32, (0, pad))
    if spec.hadamard:
        x32 = rht16(x32, spec.hadamard_signs)
    return _blocks(x32, spec.block_size)


def _block_maxima(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 max |x| of every block ``[..., nb, B] -> [..., nb]``, in cache-sized chunks."""
    flat = blocks.reshape(-1, blocks.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for lo in range(0, flat.shape[0], CHUNK_BLOCKS):
        out[lo:lo + CHUNK_BLOCKS] = flat[lo:lo + CHUNK_BLOCKS].abs().amax(-1)
    return out.reshape(blocks.shape[:-1])


def _blocks(x32: torch.Tensor, size: int) -> torch.Tensor:
    return x32.reshape(*x32.shape[:-1], x32.shape[-1] // size, size)


def quantize(
    x: torch.Tensor,
    spec: NumericsSpec | None = None,
    *,
    generator: torch.Generator | None = None,
    outer_amax: torch.Tensor | None = None,
    outer_scale: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize a 2-D ``[M, K]`` or 3-D ``[E, M, K]`` float tensor to NVFP4 under ``spec``.

    ``spec`` defaults to ``PRESETS["minite"]``. ``generator`` is required when the spec
    asks for stochastic rounding, and is consumed in element order.

    ``outer_amax`` replaces the outer maxima this tensor would give (shape ``[]`` for the
    tensor domain, ``[E]`` for experts, ``[..., M]`` for rows; fp32, floored like
    computed maxima). It is how two tensors share one outer scale, as samplers expect of
    the gate and up projections they fuse (see :func:`shared_outer_amax`).

    ``outer_scale`` is the outer scale itself, in the spec's stored convention and shaped as
    its outer domain says, for a spec whose ``outer_source`` is ``given`` (a KV cache's
    per-layer global scale; None there means 1.0 everywhere, SGLang's default for a
    checkpoint without one); any other spec refuses it. It must be finite and positive
    (:class:`NonFiniteError`, :class:`ShapeError`); ``outer_amax`` is then None.
    """
    spec = PRESETS["minite"] if spec is None else spec
    check_input(x, spec)
    if outer_scale is not None and spec.outer_source != "given":
        raise SpecError(f"preset {spec.name!r} computes its outer scale from the data: "
                        "outer_scale must be None")
    if spec.stochastic_rounding and generator is None:
        raise SpecError("stochastic rounding needs an explicit torch.Generator")
    shape = tuple(x.shape)
    math_dtype = _math_dtype(spec, x.dtype)
    blocks = _prepared_blocks(x, spec)  # [..., M, nb, B]
    vmax = _block_maxima(blocks)  # [..., M, nb]

    if spec.is_mx:
        bits = scale_math.e8m0_block_scales(vmax, spec.op_order)
        one = torch.ones((), dtype=torch.float32, device=x.device)
        codes = _encode(blocks, block_scale_values(bits.view(torch.float8_e8m0fnu)),
                        scale_math.OuterScales(enc=one, dec=one), spec, generator)
        return NVFP4Tensor(codes=codes, block_scales=bits.view(torch.float8_e8m0fnu),
                           outer_scale=None, spec=spec, shape=shape)
    if spec.outer_domain == "none":
        one = torch.ones((), dtype=torch.float32, device=x.device)
        outer_b = scale_math.OuterScales(enc=one, dec=one)
        amax = stored = None
    elif spec.outer_source == "given":
        like = _outer_amax(vmax, spec.outer_domain)
        stored = torch.ones_like(like) if outer_scale is None else \
            checked_outer_scale(outer_scale, like)
        outer = scale_math.outer_from_stored(stored, spec.outer_convention, spec.op_order,
                                             math_dtype, spec.e4m3_max)
        amax = None
        outer_b = scale_math.OuterScales(
            enc=_broadcast_outer(outer.enc, spec.outer_domain, vmax.ndim),
            dec=_broadcast_outer(outer.dec, spec.outer_domain, vmax.ndim),
        )
    else:
        amax = _outer_amax(vmax, spec.outer_domain)
        if outer_amax is not None:
            amax = checked_outer_amax(outer_amax, amax)
        if spec.amax_floor is not None:
            amax = torch.clamp(amax, min=amax.new_tensor(spec.amax_floor))
        outer = scale_math.outer_from_amax(amax, spec.op_order, math_dtype, spec.e4m3_max)
        stored = stored_outer(scale_math.stored_from_outer(outer, amax, spec.outer_convention),
                              amax, spec.four_over_six, spec.outer_convention)
        outer_b = scale_math.OuterScales(
            enc=_broadcast_outer(outer.enc, spec.outer_domain, vmax.ndim),
            dec=_broadcast_outer(outer.dec, spec.outer_domain, vmax.ndim),
        )

    if spec.four_over_six != "off":
        bits, codes = _encode_4over6(blocks, vmax, outer_b, amax, spec)
    else:
        bits, s32 = _block_scales(vmax, outer_b, spec, math_dtype)
        codes = _encode(blocks, s32, outer_b, spec, generator)
    return NVFP4Tensor(
        codes=codes,
        block_scales=bits.view(torch.float8_e4m3fn),
        outer_scale=stored,
        spec=spec,
        shape=shape,
        outer_amax=amax,
    )


def _encode_4over6(blocks, vmax, outer_b, amax, spec):
    """Block-scale bytes and packed codes under 4-over-6 (:mod:`libalign.spec.four_over_six`)."""
    grid = vmax.shape
    size = spec.block_size
    amax_b = _broadcast_outer(amax, spec.outer_domain, vmax.ndim)
    bits, codes = encode_4over6(
        blocks.reshape(-1, size), vmax.reshape(-1), _per_block(outer_b.enc, grid),
        _per_block(outer_b.dec, grid), _per_block(amax_b, grid), e4m3_max=spec.e4m3_max,
        rule=spec.four_over_six, metric=spec.four_over_six_error, signed_zero=spec.signed_zero)
    return bits.reshape(grid), pack_nibbles(codes).reshape(*grid[:-1], grid[-1] * (size // 2))


def checked_outer_amax(given: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
    """A caller's ``outer_amax`` as fp32 on the device of ``computed`` (the maxima this input
    would give), refused unless it has their shape and is finite and non-negative."""
    if not isinstance(given, torch.Tensor):
        raise DTypeError(f"outer_amax must be a torch.Tensor, got {type(given).__name__}")
    if tuple(given.shape) != tuple(computed.shape):
        raise ShapeError(f"outer_amax has shape {tuple(given.shape)}, this outer domain "
                         f"needs {tuple(computed.shape)}")
    given = given.to(device=computed.device, dtype=torch.float32)
    if not bool(torch.isfinite(given).all()) or bool((given < 0).any()):
        raise NonFiniteError("outer_amax", int((~torch.isfinite(given)).sum()),
                             int(torch.isnan(given).sum()), int(torch.isinf(given).sum()), [])
    return given


def checked_outer_scale(given: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A caller's ``outer_scale`` as fp32 on the device of ``like`` (one value per outer domain),
    refused unless it has that shape and is finite and positive, with an encode scale that is
    finite too (a subnormal decode scale's reciprocal overflows)."""
    if not isinstance(given, torch.Tensor):
        raise DTypeError(f"outer_scale must be a torch.Tensor, got {type(given).__name__}")
    if tuple(given.shape) != tuple(like.shape):
        raise ShapeError(f"outer_scale has shape {tuple(given.shape)}, this outer domain "
                         f"needs {tuple(like.shape)}")
    given = given.to(device=like.device, dtype=torch.float32)
    bad = ~torch.isfinite(given) | (given <= 0) | ~torch.isfinite(torch.reciprocal(given))
    if bool(bad.any()):
        first = torch.nonzero(bad)[:5].tolist()
        raise NonFiniteError("outer_scale", int(bad.sum()), int(torch.isnan(given).sum()),
                             int(torch.isinf(given).sum()), [tuple(ix) for ix in first])
    return given


def shared_outer_amax(tensors: list[torch.Tensor], spec: NumericsSpec) -> torch.Tensor:
    """One outer maximum for several tensors of the same outer-domain shape.

    The gate and up projections of an expert are separate tensors in a checkpoint but
    one fused GEMM in a sampler, which needs them to share one outer scale. For the
    ``tensor`` and ``expert`` domains this returns the elementwise maximum of each
    tensor's own outer maxima. For the ``row`` domain every row is its own domain
    already, so sharing is not needed: it is refused to avoid a silent no-op.
    """
    if spec.outer_domain not in ("tensor", "expert"):
        raise SpecError(f"a shared outer amax needs the tensor or expert domain, "
                        f"preset {spec.name!r} has {spec.outer_domain!r}")
    out = None
    for t in tensors:
        check_input(t, spec)
        # the same preparation and maxima quantize() computes (NaN/Inf policy, padding,
        # rotation), so the shared value is exactly what each tensor would have used
        a = _outer_amax(_block_maxima(_prepared_blocks(t, spec)), spec.outer_domain)
        if out is not None and a.shape != out.shape:
            raise ShapeError(f"shared outer amax over tensors with different outer domains: "
                             f"{tuple(out.shape)} vs {tuple(a.shape)}")
        out = a if out is None else torch.maximum(out, a)
    if out is None:
        raise ShapeError("shared_outer_amax needs at least one tensor")
    return out


def _per_block(t: torch.Tensor, grid_shape: torch.Size) -> torch.Tensor:
    """An outer-scale tensor broadcast to one value per block, flattened to ``[n, 1]``."""
    if t.ndim == 0:
        return t
    return t.expand(grid_shape).reshape(-1, 1)


def _encode(blocks, s32, outer_b, spec, generator) -> torch.Tensor:
    """Packed E2M1 codes of fp32 blocks ``[..., nb, B]`` under given scales (step 6-7)."""
    grid = s32.shape  # [..., M, nb]
    size = spec.block_size
    flat = blocks.reshape(-1, size)
    s_flat = s32.reshape(-1, 1)
    enc, dec = _per_block(outer_b.enc, grid), _per_block(outer_b.dec, grid)
    mult = 0.0 if spec.zero_scale_encode == "zero" else FLT_MAX
    any_zero = bool((s_flat == 0).any())  # one check, not one device sync per chunk
    # stochastic rounding consumes its generator in element order over the whole tensor
    step = flat.shape[0] if spec.stochastic_rounding else CHUNK_BLOCKS
    out = torch.empty((flat.shape[0], size // 2), dtype=torch.uint8, device=flat.device)
    for lo in range(0, flat.shape[0], max(step, 1)):
        hi = lo + step
        xb, sb = flat[lo:hi], s_flat[lo:hi]
        ob = scale_math.OuterScales(enc=enc if enc.ndim == 0 else enc[lo:hi],
                                    dec=dec if dec.ndim == 0 else dec[lo:hi])
        scaled = scale_math.encode_blocks(xb, sb, ob, spec.op_order)
        if any_zero:
            scaled = torch.where(sb == 0, xb * mult, scaled)
        scaled = scaled.clamp_(-E2M1_MAX, E2M1_MAX)
        if spec.stochastic_rounding:
            codes = round_e2m1_stochastic(scaled, generator, spec.signed_zero)
        else:
            codes = round_e2m1(scaled, spec.signed_zero, spec.e2m1_ties)
        out[lo:hi] = pack_nibbles(codes)
    return out.reshape(*grid[:-1], grid[-1] * (size // 2))


def encode_with_scales(
    x: torch.Tensor, q: NVFP4Tensor, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Packed codes of ``x`` encoded with ``q``'s block and outer scales (not its own).

    This is what a consumer does when it must agree with a producer's scales: re-encoding
    ``dequantize(q)`` this way reproduces ``q.codes`` exactly.
    """
    spec = q.spec
    if tuple(x.shape) != q.shape:
        raise ShapeError(f"x has shape {tuple(x.shape)}, the scales belong to shape {q.shape}")
    blocks = _prepared_blocks(x, spec)
    s32 = block_scale_values(q.block_scales)
    outer = q.outer()
    outer_b = scale_math.OuterScales(
        enc=_broadcast_outer(outer.enc, spec.outer_domain, s32.ndim),
        dec=_broadcast_outer(outer.dec, spec.outer_domain, s32.ndim),
    )
    return _encode(blocks, s32, outer_b, spec, generator)


def normalized_with_scales(
    x: torch.Tensor, block_scales: torch.Tensor, outer_scale: torch.Tensor | None,
    spec: NumericsSpec,
) -> torch.Tensor:
    """``x`` normalized by given scales, as the encoder sees it before rounding: fp32 ``[..., nb, B]``.

    ``block_scales`` (E4M3, or E8M0 for an MX spec, ``[..., nb]``) and ``outer_scale``
    (stored convention, shaped as ``spec.outer_domain`` says) usually come from another
    producer; the values are the scaled, clamped elements that step 7 would round, in the
    spec's operation order and zero-scale policy, so rounding them to nearest reproduces
    :func:`encode_with_scales`.
    Guided rounding (:func:`libalign.spec.rounding.round_e2m1_guided`) rounds them instead.
    """
    shape = tuple(x.shape)
    size = spec.block_size
    scale_dtype = spec.scale_dtype
    bits = block_scales.view(torch.uint8) if block_scales.dtype == scale_dtype else block_scales
    if bits.dtype != torch.uint8:
        raise DTypeError(f"block scales of spec {spec.name!r} must be {scale_dtype} or uint8, "
                         f"got {block_scales.dtype}")
    if tuple(bits.shape) != (*shape[:-1], -(-shape[-1] // size)):
        raise ShapeError(f"block scales of shape {tuple(bits.shape)} do not fit values of shape "
                         f"{shape}")
    carrier = NVFP4Tensor(bits.new_empty(0), bits.view(scale_dtype), outer_scale, spec, shape)
    blocks = _prepared_blocks(x, spec)
    s32 = block_scale_values(bits.view(scale_dtype))
    outer = carrier.outer()
    grid = s32.shape
    enc = _per_block(_broadcast_outer(outer.enc, spec.outer_domain, s32.ndim), grid)
    dec = _per_block(_broadcast_outer(outer.dec, spec.outer_domain, s32.ndim), grid)
    flat, s_flat = blocks.reshape(-1, size), s32.reshape(-1, 1)
    scaled = scale_math.encode_blocks(flat, s_flat, scale_math.OuterScales(enc=enc, dec=dec),
                                      spec.op_order)
    if bool((s_flat == 0).any()):
        mult = 0.0 if spec.zero_scale_encode == "zero" else FLT_MAX
        scaled = torch.where(s_flat == 0, flat * mult, scaled)
    return scaled.clamp_(-E2M1_MAX, E2M1_MAX).reshape(*grid, size)


#: E2M1 magnitude code after halving its value and rounding to nearest-even
#: (0.5 -> 0.25 -> 0, 1.5 -> 0.75 -> 1.0), and after scaling it by 2^-127 (always 0).
_MX_BYTE0_HALVED = (0, 0, 1, 2, 2, 3, 4, 5)
_MX_BYTE0_TE = (0,) * 8


def roundtrip_codes(q: NVFP4Tensor) -> torch.Tensor:
    """The packed codes that re-encoding ``dequantize(q)`` with ``q``'s scales yields.

    Equal to ``q.codes`` except where two codes decode to the same value: under
    ``sign_of_nonzero`` the code 0x8 decodes to -0.0, which encodes as 0x0; under the
    ``saturate`` zero-scale policy a zero-scale block's +-6 codes decode to zeros (signed zeros
    under ``sign_of_input``, whose code 0x8 they re-encode to). MXFP4's
    scale byte 0x00 decodes as 2^-127 but torchao's rule encodes with 2^-126, so such a
    block re-encodes at half its magnitude (``mx_te`` encodes it with multiplier 1, so its
    decoded values re-encode to zero); the sign bit stays.
    """
    codes = unpack_nibbles(q.codes)
    if q.spec.is_mx:
        table = _MX_BYTE0_TE if q.spec.op_order == "mx_te" else _MX_BYTE0_HALVED
        byte0 = (q.block_scales.view(torch.uint8) == 0).repeat_interleave(q.spec.block_size,
                                                                          dim=-1)
        mags = torch.tensor(table, dtype=torch.uint8, device=codes.device)[(codes & 7).long()]
        codes = torch.where(byte0, (codes & 8) | mags, codes)
    if q.spec.signed_zero == "sign_of_nonzero":
        codes = canonical_zero(codes)
    if q.spec.zero_scale_encode == "saturate":
        zero = (q.block_scales.view(torch.uint8) == 0).repeat_interleave(q.spec.block_size,
                                                                         dim=-1)
        # its +-6 codes decode to +-0, which keep their sign only under sign_of_input
        kept = codes & 8 if q.spec.signed_zero == "sign_of_input" else torch.zeros_like(codes)
        codes = torch.where(zero, kept, codes)
    return pack_nibbles(codes)


def _block_scales(vmax, outer, spec, math_dtype):
    """E4M3 block-scale bytes and their fp32 values (steps 5 of the module doc)."""
    pre = scale_math.block_prescale(vmax, outer, spec.op_order, math_dtype)
    if spec.zero_prescale_to is not None:
        pre = torch.where(pre == 0, pre.new_tensor(spec.zero_prescale_to), pre)
    undefined = torch.isnan(pre)
    if bool(undefined.any()):
        first = torch.nonzero(undefined)[:3].tolist()
        raise UndefinedScaleError(
            f"preset {spec.name!r} computes {int(undefined.sum())} NaN block scale(s) "
            f"(first blocks {first}); its library divides 0 by 0 for an all-zero "
            f"{spec.outer_domain}"
        )
    bits = round_e4m3_bits(saturate_e4m3(pre, spec.block_scale_floor))
    s32 = e4m3_bits_to_float(bits)
    if spec.zero_scale_to is not None:
        zero = s32 == 0
        if bool(zero.any()):
            sub = s32.new_tensor([spec.zero_scale_to])
            bits = torch.where(zero, round_e4m3_bits(sub), bits)
            s32 = torch.where(zero, sub, s32)
    return bits, s32


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32, *,
               rotated: bool = False) -> torch.Tensor:
    """Reconstruct ``q`` as a ``dtype`` tensor of its logical shape.

    Values are formed in fp32 in the spec's dequantization order (``scale_math``) and
    rounded once to ``dtype``. For a Hadamard spec the rotation is undone unless
    ``rotated=True`` (what a GEMM whose operands are both rotated consumes).
    """
    codes = unpack_nibbles(q.codes)
    size = q.spec.block_size
    vals = _blocks(e2m1_code_values(codes), size)
    s32 = block_scale_values(q.block_scales).unsqueeze(-1)
    outer = q.outer()
    dom = q.spec.outer_domain
    nd = s32.ndim - 1  # ndim of the [..., M, nb] block grid
    enc = _broadcast_outer(outer.enc, dom, nd)
    dec = _broadcast_outer(outer.dec, dom, nd)
    if enc.ndim:
        enc, dec = enc.unsqueeze(-1), dec.unsqueeze(-1)
    out = scale_math.dequantize_blocks(vals, s32, scale_math.OuterScales(enc, dec),
                                       q.spec.op_order)
    out = out.reshape(*out.shape[:-2], out.shape[-2] * size)
    if q.spec.hadamard and not rotated:
        out = rht16_inverse(out, q.spec.hadamard_signs)
    return out[..., : q.shape[-1]].to(dtype)
