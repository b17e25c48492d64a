"""Pins libalign.gemm.finite_checks: immediate checks raise at the call, deferred ones at the end
of their block, naming the call, with element detail while the activations live and row
detail (in the caller's rows) after they are gone; an exception inside a block wins."""

from __future__ import annotations

import gc

import pytest
import torch
from alignclient.errors import NonFiniteError

from libalign.gemm.finite_checks import check_rows, deferred_finite_checks


def _rows(m: int = 6, k: int = 8, bad: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and their row decode scales (amax / 6, non-finite where a row is)."""
    x = torch.randn(m, k)
    for (r, c), v in (bad or {}).items():
        x[r, c] = v
    return x, x.abs().amax(-1) / 6.0


def test_outside_a_block_a_nonfinite_row_raises_at_the_call():
    """No block: the call itself raises, with counts and the first position."""
    x, dec = _rows(bad={(2, 3): float("nan"), (4, 0): float("inf")})
    with pytest.raises(NonFiniteError) as e:
        check_rows(dec, x, "activations")
    assert (e.value.count, e.value.nan, e.value.inf) == (2, 1, 1)
    assert e.value.first_indices == [(2, 3), (4, 0)]
    good, gdec = _rows()
    check_rows(gdec, good)  # finite: nothing


def test_inside_a_block_the_error_comes_at_its_end_naming_the_call():
    """Queued calls do not raise; the block's end raises for the first bad call (of three),
    with the element detail of the still-held activations."""
    good, gdec = _rows()
    bad, bdec = _rows(bad={(1, 7): float("nan")})
    worse, wdec = _rows(bad={(0, 0): float("inf")})
    reached = False
    raises = pytest.raises(NonFiniteError, match=r"call 2 of 3 in a deferred check")
    with raises as e, deferred_finite_checks() as checks:
        check_rows(gdec, good)
        check_rows(bdec, bad)
        check_rows(wdec, worse)
        assert checks.count == 3
        reached = True
    assert reached
    assert (e.value.count, e.value.nan, e.value.inf) == (1, 1, 0)
    assert e.value.first_indices == [(1, 7)]


def test_after_the_activations_are_gone_the_error_names_rows_in_the_callers_order():
    """Only a weak reference is kept: once the tensor is freed, the error counts the
    non-finite rows, mapped from the padded layout to the caller's rows by ``rows_of``."""
    x, _ = _rows(bad={(3, 1): float("nan"), (5, 2): float("inf")})
    padded = torch.cat([x[:4], torch.zeros(2, x.shape[1]), x[4:]])  # 2 padding rows after row 3
    pdec = padded.abs().amax(-1) / 6.0

    def unpad(d):
        return torch.cat([d[:4], d[6:]])

    with pytest.raises(NonFiniteError, match="no longer held") as e, deferred_finite_checks():
        check_rows(pdec, x, "activations", unpad)
        del x, padded
        gc.collect()
    assert (e.value.count, e.value.nan, e.value.inf) == (2, 1, 1)
    assert e.value.first_indices == [(3,), (5,)]


def test_an_exception_inside_the_block_propagates_and_drops_the_checks():
    """A block that raises re-raises its own error, not the queued NonFiniteError."""
    bad, bdec = _rows(bad={(0, 0): float("nan")})
    with pytest.raises(KeyError), deferred_finite_checks():
        check_rows(bdec, bad)
        raise KeyError("first")
    check_rows(*_rows()[::-1])  # nothing is left queued: an immediate check of good rows passes


def test_blocks_nest_and_each_verifies_its_own_calls():
    """An inner block raises for its own bad call at its own end; the outer one only sees
    calls made directly in it."""
    good, gdec = _rows()
    bad, bdec = _rows(bad={(2, 2): float("nan")})
    with deferred_finite_checks() as outer:
        check_rows(gdec, good)
        with pytest.raises(NonFiniteError, match="call 1 of 1"), deferred_finite_checks() as inner:
            check_rows(bdec, bad)
        assert inner.count == 0 and outer.count == 1
    assert outer.count == 0


def test_finite_calls_pass_and_leave_nothing_queued():
    """Many finite calls: the block ends without error, and verify() forgets them."""
    with deferred_finite_checks() as checks:
        for _ in range(5):
            check_rows(*_rows()[::-1])
        assert checks.count == 5
    assert checks.count == 0


def test_no_rows_is_nothing_to_check():
    """An empty call (an expert-parallel rank with no tokens) queues nothing and raises nothing."""
    x = torch.empty(0, 8)
    check_rows(x.abs().amax(-1), x)
    with deferred_finite_checks() as checks:
        check_rows(x.abs().amax(-1), x)
        assert checks.count == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_nan_token_stops_generation_and_scoring_with_the_typed_error(device):
    """A prompt token whose embedding is NaN: generate and score_sequences raise
    NonFiniteError from the expert GEMM's check (on CUDA at the end of the forward, before
    anything samples from NaN logits), and the device still works afterwards."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("transformers")
    from libalign import models

    model = models.build_model(models.tiny_config(num_hidden_layers=1), seed=0, device=device)
    emb = model.get_input_embeddings().weight
    kept = emb[7].clone()
    with torch.no_grad():
        emb[7] = float("nan")
    prompts = [[1, 2, 3], [4, 7, 5]]
    with pytest.raises(NonFiniteError, match="activations"):
        models.generate(model, prompts, "nvfp4_minite", max_new_tokens=3, pad_id=0)
    with pytest.raises(NonFiniteError, match="activations"):
        models.score_sequences(model, [[*p, 6] for p in prompts], [3, 3], "nvfp4_minite")
    with torch.no_grad():
        emb[7] = kept
    clean = models.generate(model, prompts, "nvfp4_minite", max_new_tokens=3, pad_id=0)
    assert len(clean.sequences[0]) > 3 and torch.isfinite(clean.logprobs[0]).all()
