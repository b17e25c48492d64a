"""NVFP4 refit inside the trainers' own weight sync: thin adapters over
:func:`alignd.sync.stream.quantize_named`.

Each trainer already produces Hugging Face-named tensors on its way to SGLang; an adapter only
decides, from the checkpoint's ``quantization_config``, which spec to quantize under and what to
leave alone, and returns the tensors in the names SGLang's ``libalign_minite`` (or, for a
tensor-scaled preset, ``modelopt_fp4``) method loads:

Miles and slime (Megatron)
    Their ``convert_to_hf`` turns one Megatron parameter into its Hugging Face tensors, then
    ``quantize_params(args, megatron_name, converted_named_params, quantization_config)``
    quantizes them for the rollout engine's method. :func:`quantize_params` is that function
    for a ``libalign_*`` quant method: call it from the trainer's dispatch where
    ``quant_method`` starts with ``libalign``. One call holds a parameter's fused siblings
    together (``linear_fc1`` -> gate and up, ``linear_qkv`` -> q, k, v), so tensor-scaled
    presets share their maximum within it.
verl
    Its SGLang rollout takes an iterator of ``(name, tensor)`` before ``update_weights``;
    :func:`verl_weights` wraps that iterator.
SGLang
    The server side needs no adapter for ``flattened_bucket`` refits; staged refits name
    ``--custom-weight-loader alignd.sync.tensor.load_refit`` (:mod:`alignd.sync.tensor`).

What is quantized: every linear weight the selection policy takes with ``all_linear``
(:mod:`alignd.formats.selection`) except the modules the config excludes
(``exclude_modules`` / ``ignore``, matched as SGLang matches them: a module name equal to an
entry, or under it); what the checkpoint kept in BF16 stays BF16.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from alignclient.errors import ConfigError

from alignd.formats.quant_configs import MINITE_METHOD, MINITE_SPEC
from alignd.formats.selection import make_select
from alignd.sync.stream import DEFAULT_BUCKET_BYTES, quantize_named

#: ``quant_method`` values the adapters serve, and the spec each quantizes under by default.
METHODS = {MINITE_METHOD: MINITE_SPEC, "libalign": MINITE_SPEC}


def spec_of(quantization_config: Mapping[str, Any] | None) -> str:
    """The preset a ``libalign_*`` ``quantization_config`` names (its ``spec``, else the
    method's default); ConfigError for another method."""
    if not quantization_config:
        raise ConfigError("an NVFP4 refit needs the checkpoint's quantization_config "
                          f"(quant_method {MINITE_METHOD!r})")
    method = quantization_config.get("quant_method")
    if method not in METHODS:
        raise ConfigError(f"quantization_config names quant_method {method!r}; libalign's "
                          f"adapters serve {sorted(METHODS)}")
    return str(quantization_config.get("spec") or METHODS[method])


def _excluded(quantization_config: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key in ("exclude_modules", "ignore"):
        v = quantization_config.get(key) or []
        out += [v] if isinstance(v, str) else list(v)
    return out


def _is_excluded(name: str, excluded: list[str]) -> bool:
    module = name.removesuffix(".weight")
    return any(module == e or module.startswith(e + ".") for e in excluded)


def _selected(named: Iterable[tuple[str, torch.Tensor]], excluded: list[str]
              ) -> Iterator[tuple[str, torch.Tensor, bool]]:
    select = make_select(all_linear=True)
    for name, t in named:
        yield name, t, select(name, t) and not _is_excluded(name, excluded)


def convert_named(named: Iterable[tuple[str, torch.Tensor]],
                  quantization_config: Mapping[str, Any], *,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with every tensor the config quantizes quantized (module doc), in SGLang's
    names; excluded ones pass through unchanged, in order among themselves."""
    spec = spec_of(quantization_config)
    excluded = _excluded(quantization_config)
    kept: list[tuple[str, torch.Tensor]] = []

    def chosen() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t, take in _selected(named, excluded):
            if take:
                yield name, t
            else:
                kept.append((name, t))

    for item in quantize_named(chosen(), spec, all_linear=True, bucket_bytes=bucket_bytes):
        while kept:
            yield kept.pop(0)
        yield item
    yield from kept


def quantize_params(args: Any, megatron_name: str,
                    converted_named_params: list[tuple[str, torch.Tensor]],
                    quantization_config: Mapping[str, Any] | None) -> list[tuple[str, torch.Tensor]]:
    """Miles/slime's ``quantize_params`` for a ``libalign_*`` method: one Megatron
    parameter's converted tensors, quantized (``args`` and ``megatron_name`` are the
    trainer's, unused: the Hugging Face names decide)."""
    del args, megatron_name
    return list(convert_named(converted_named_params, quantization_config or {}))


def verl_weights(weights: Iterable[tuple[str, torch.Tensor]],
                 quantization_config: Mapping[str, Any], *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """verl's ``(name, tensor)`` generator for SGLang's ``update_weights``, quantized on the
    way (lazily: at most one bucket of input is held)."""
    return convert_named(weights, quantization_config, bucket_bytes=bucket_bytes)
