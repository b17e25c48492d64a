"""libalign.sync.quantize_into: destinations hold the spec's bits, errors name the source.

On the CPU every call goes through the CPU kernel (or the spec) and is copied in; on a CUDA
device (marked gpu) both the colocated path (the kernel writes the destination) and the
host path (staging sets, a copy stream, events) run over alternating shapes, so a staging
set is reused while the copy of the other one is in flight.
"""

from __future__ import annotations

import pytest
import torch
from alignclient.errors import NonFiniteError, SpecError

from libalign.spec import PRESETS, quantize
from libalign.sync import empty_destination, quantize_into
from tests.libalign import inputs
from tests.libalign.test_ops_kernels import assert_bitwise

PRESET_NAMES = ["minite", "te", "torchao", "modelopt", "te_row"]


def layer_stacks(device, layers=3, seed=0):
    """Two shapes per layer, alternating (K=256 and K=96), BF16, adversarial families."""
    out = []
    for i in range(layers):
        out.append(inputs.randn((2, 24, 256), seed=seed + 2 * i).to(torch.bfloat16).to(device))
        out.append(inputs.tie_heavy((2, 40, 96)).to(torch.bfloat16).to(device) * (i + 1))
    return out


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_cpu_destinations_hold_the_spec_bits(preset):
    spec = PRESETS[preset]
    xs = [*layer_stacks("cpu"), inputs.randn((8, 64), seed=9)]
    dst = [empty_destination(x, spec) for x in xs]
    quantize_into(xs, dst, spec)
    for x, d in zip(xs, dst, strict=True):
        assert_bitwise(d, quantize(x, spec))


def test_bad_destinations_are_refused_naming_the_index():
    spec = PRESETS["minite"]
    xs = layer_stacks("cpu", layers=1)
    good = [empty_destination(x, spec) for x in xs]
    with pytest.raises(SpecError, match="2 sources but 1 destinations"):
        quantize_into(xs, good[:1], spec)
    with pytest.raises(SpecError, match="destination 1 has shape"):
        quantize_into(xs, [good[0], good[0]], spec)
    with pytest.raises(SpecError, match=r"destination 0 has shape .* spec 'te'"):
        quantize_into(xs[:1], [empty_destination(xs[0], PRESETS["te"])], spec)
    with pytest.raises(SpecError, match="destination 0 must be an NVFP4Tensor"):
        quantize_into(xs[:1], [xs[0]], spec)
    with pytest.raises(SpecError, match="multiple of 16"):
        empty_destination(torch.zeros(4, 40), PRESETS["modelopt"])


def test_nonfinite_source_raises_the_spec_error():
    spec = PRESETS["minite"]
    xs = layer_stacks("cpu", layers=1)
    xs[1] = xs[1].clone()
    xs[1][1, 3, 5] = float("inf")
    with pytest.raises(NonFiniteError, match=r"\(1, 3, 5\)"):
        quantize_into(xs, [empty_destination(x, spec) for x in xs], spec)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["colocated", "host"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_gpu_destinations_hold_the_spec_bits(preset, where):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = PRESETS[preset]
    xs = layer_stacks("cuda", layers=4)
    dev, pin = ("cuda", False) if where == "colocated" else ("cpu", True)
    dst = [empty_destination(x, spec, device=dev, pin_memory=pin) for x in xs]
    for d in dst:  # poison: every byte must be written
        d.codes.fill_(0xAB)
        d.block_scales.view(torch.uint8).fill_(0xCD)
    quantize_into(xs, dst, spec)
    for x, d in zip(xs, dst, strict=True):
        assert d.codes.device.type == dev
        assert_bitwise(d, quantize(x.cpu(), spec))


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["colocated", "host"])
def test_gpu_nonfinite_source_raises_naming_it(where):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = PRESETS["te"]
    xs = layer_stacks("cuda", layers=2)
    xs[3] = xs[3].clone()
    xs[3][0, 2, 7] = float("nan")
    dev, pin = ("cuda", False) if where == "colocated" else ("cpu", True)
    dst = [empty_destination(x, spec, device=dev, pin_memory=pin) for x in xs]
    with pytest.raises(NonFiniteError, match=r"\(0, 2, 7\)") as err:
        quantize_into(xs, dst, spec)
    assert "source 3 of 4" in "".join(getattr(err.value, "__notes__", []))


def expert_weights(device, experts=5, shape=(24, 256), seed=20):
    """Per-expert 2-D weights, each its own tensor (a trainer's), adversarial families."""
    return [(inputs.randn(shape, seed=seed + e) if e % 2 else inputs.tie_heavy(shape) * (e + 1))
            .to(torch.bfloat16).to(device) for e in range(experts)]


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_stacked_sources_hold_the_stacks_bits(preset, monkeypatch):
    """A Stacked source quantizes to the bits of its stack: read in place by the CPU library
    under a row-scaled preset (one call for the run), stacked first under the others; mixed
    with plain sources in one call."""
    from libalign.kernels import calls, native
    from libalign.sync import Stacked

    spec = PRESETS[preset]
    gathered = []
    real = calls.launch_gather
    monkeypatch.setattr(calls, "launch_gather",
                        lambda *a, **k: gathered.append(len(a[1])) or real(*a, **k))
    runs = [expert_weights("cpu"), expert_weights("cpu", experts=3, shape=(8, 96), seed=40)]
    sources = [Stacked(tuple(runs[0])), inputs.randn((8, 64), seed=9), Stacked(tuple(runs[1]))]
    dst = [empty_destination(torch.stack(r), spec) for r in runs]
    dst.insert(1, empty_destination(sources[1], spec))
    quantize_into(sources, dst, spec)
    assert_bitwise(dst[0], quantize(torch.stack(runs[0]), spec))
    assert_bitwise(dst[1], quantize(sources[1], spec))
    assert_bitwise(dst[2], quantize(torch.stack(runs[1]), spec))
    served = spec.outer_domain == "row" and native.load("cpu") is not None
    assert gathered == ([5, 3] if served else [])


def test_stacked_sources_refuse_mixed_tensors_and_name_a_non_finite_value():
    """A Stacked source of tensors that do not stack is refused naming the odd one; a NaN in
    one of its tensors raises the spec's error at its position in the stack."""
    from libalign.sync import Stacked

    with pytest.raises(SpecError, match=r"tensor 2 is \(8, 32\)"):
        Stacked((torch.zeros(8, 64), torch.zeros(8, 64), torch.zeros(8, 32)))
    with pytest.raises(SpecError, match="at least one tensor"):
        Stacked(())
    spec = PRESETS["minite"]
    ws = expert_weights("cpu", experts=4)
    ws[3] = ws[3].clone()
    ws[3][5, 17] = float("nan")
    with pytest.raises(NonFiniteError, match=r"\(3, 5, 17\)"):
        quantize_into([Stacked(tuple(ws))], [empty_destination(torch.stack(ws), spec)], spec)


def test_stacked_sources_the_kernels_cannot_read_in_place_are_stacked_first():
    """Tensors that are not contiguous (a transposed view) still give the stack's bits: the
    stack is made first."""
    from libalign.sync import Stacked

    spec = PRESETS["minite"]
    ws = [w.t().contiguous().t() for w in expert_weights("cpu", experts=3, shape=(64, 32))]
    assert not ws[0].is_contiguous()
    d = empty_destination(torch.stack(ws), spec)
    quantize_into([Stacked(tuple(ws))], [d], spec)
    assert_bitwise(d, quantize(torch.stack(ws), spec))


@pytest.mark.gpu
def test_gpu_stacked_sources_hold_the_stacks_bits():
    """On a CUDA device the kernels read 128 per-expert weights in place (one launch) and
    write the stack's bits into a poisoned destination; a NaN raises at its position."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from libalign.sync import Stacked

    spec = PRESETS["minite"]
    for shape in ((24, 256), (40, 2048), (16, 768)):
        ws = expert_weights("cuda", experts=128, shape=shape)
        d = empty_destination(torch.stack(ws), spec)
        d.codes.fill_(0xAB)
        d.block_scales.view(torch.uint8).fill_(0xCD)
        quantize_into([Stacked(tuple(ws))], [d], spec)
        assert_bitwise(d, quantize(torch.stack(ws).cpu(), spec))
    ws[70] = ws[70].clone()
    ws[70][3, 9] = float("nan")
    with pytest.raises(NonFiniteError, match=r"\(70, 3, 9\)"):
        quantize_into([Stacked(tuple(ws))], [empty_destination(torch.stack(ws), spec)], spec)
