"""Pins context independence: row-scaled bits ignore companion rows, per-tensor bits do not."""

import pytest
import torch
from alignclient.errors import ShapeError

from libalign.context import CONTEXTS, context_swap
from libalign.spec import PRESETS


def _activations(seed=0):
    """A 128 x 2048 FC1 input with outlier companions, like captured sampler activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 2048, generator=g) * torch.exp(torch.randn(128, 1, generator=g))
    x[::9] *= 30
    return x.to(torch.bfloat16)


def _pool(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(300, 2048, generator=g) * torch.exp(2 * torch.randn(300, 1, generator=g))
            ).to(torch.bfloat16)


def _middle_targets(x, n=8):
    order = torch.argsort(x.float().abs().amax(-1))
    mid = len(order) // 2
    return order[mid - n // 2: mid + n // 2].tolist()


@pytest.mark.parametrize("preset", ["minite", "te_row"])
def test_row_scaled_presets_are_context_independent(preset):
    """Targets' codes, scales, outer scales and values identical in all four contexts."""
    x = _activations()
    report = context_swap(x, _middle_targets(x), PRESETS[preset], pool=_pool())
    assert [c.context for c in report.cases] == list(CONTEXTS)
    assert report.independent, report.changed()
    assert len({c.payload_sha256 for c in report.cases}) == 1


def test_per_tensor_preset_shows_the_change():
    """The per-tensor te preset changes its target bits when companions change amax."""
    x = _activations()
    report = context_swap(x, _middle_targets(x), PRESETS["te"], pool=_pool())
    assert not report.independent
    assert {"low_amplitude", "high_amplitude", "zero_padding"} <= set(report.changed())
    assert report.cases[0].identical  # the original context is the reference


def test_negative_control_amax_held_by_targets():
    """If a target row holds the tensor max, low/zero companions leave per-tensor bits alone."""
    x = _activations()
    targets = _middle_targets(x)
    x[targets[0], 0] = 1e4  # the tensor maximum now lives in a target row
    pool = _pool() / 1000  # every replacement is smaller
    report = context_swap(x, targets, PRESETS["te"], pool=pool)
    assert report.independent, report.changed()


def test_bad_arguments():
    """Non-2-D inputs, empty or out-of-range targets and mismatched pools are ShapeErrors."""
    x = _activations()
    with pytest.raises(ShapeError):
        context_swap(x[None], [0], PRESETS["minite"])
    with pytest.raises(ShapeError):
        context_swap(x, [], PRESETS["minite"])
    with pytest.raises(ShapeError):
        context_swap(x, [128], PRESETS["minite"])
    with pytest.raises(ShapeError):
        context_swap(x, [0], PRESETS["minite"], pool=torch.zeros(4, 16))
