"""Pins alignd.integrations: the gap under slime's, verl's and libalign's names (against verl's
own function where verl imports, and against copies of both frameworks' formulas), the
Prometheus families on the trainer's registry, the background push (never blocking a step,
counted, bounded in batches and bytes, retried through a 500, landing once the API is back),
publishing from tensors (retryable after a failed registration, nothing left behind), guidance
as tensors, every call ending by its deadline, and the README snippets."""

from __future__ import annotations

import math
import runpy
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from alignclient import AlignClient
from alignclient.errors import (
    ApiTimeoutError,
    ForbiddenError,
    InputError,
    InternalError,
    NonFiniteError,
    ShapeError,
    VersionExistsError,
    VersionNotFoundError,
)
from alignclient.retry import RetryPolicy
from alignd.api.app import create_app
from alignd.formats.convert import convert_published
from alignd.formats.published import publish_id, write_published
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus, connect
from alignd.infra.events import event_stream
from alignd.infra.registry import Registry
from alignd.integrations import SLIME_ABS_DIFF, VERL_KEYS, Monitor, WeightPublisher, gap_metrics
from alignd.sync.bf16 import publish_version

from libalign.guidance import GuidanceRecord, SiteRows
from libalign.metrics import delta_stats, tis_weights, token_deltas
from tests.services import verl_source
from tests.services.api_server import TOKEN, api_settings, serve
from tests.services.conftest import free_port, tiny_experts
from tests.services.faulty_servers import Drip, FailSome

ROOT = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(initial_s=0.02, max_s=0.2, attempts=10_000)


def batch(b=4, t=16, dtype=torch.float64, seed=0, empty_row=False):
    g = torch.Generator().manual_seed(seed)
    learner = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 4).to(dtype)
    sampler = (learner.double() + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
               ).clamp(max=0.0).to(dtype)
    lengths = torch.randint(1, t + 1, (b, 1), generator=g)
    if empty_row:
        lengths[1] = 0
    mask = torch.arange(t).expand(b, t) < lengths
    return learner, sampler, mask


# --- the values: verl ---------------------------------------------------------------------


def verl_reference(actor, rollout, mask):
    """A copy of verl 0.9.1's ``calculate_debug_metrics`` (verl/utils/debug/metrics.py): the
    probabilities exp(logp), |actor − rollout| over the response mask, its max, mean and
    ``torch.std``, and the Pearson correlation of the masked probabilities."""
    actor_probs, rollout_probs = torch.exp(actor), torch.exp(rollout)
    m = mask.bool()
    diff = torch.masked_select(torch.abs(actor_probs - rollout_probs), m)
    corr = torch.corrcoef(torch.stack([torch.masked_select(actor_probs, m),
                                       torch.masked_select(rollout_probs, m)]))[0][1].item()
    return {"training/rollout_probs_diff_valid": 1,
            "training/rollout_probs_diff_max": torch.max(diff).item(),
            "training/rollout_probs_diff_mean": torch.mean(diff).item(),
            "training/rollout_probs_diff_std": torch.std(diff).item(),
            "training/rollout_actor_probs_pearson_corr": corr}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_verl_names_equal_verls_formula(dtype):
    """The training/rollout_probs_diff_* values are verl's formula: bit for bit on float64
    inputs (the correlation to 1e-12), to float32 rounding on float32 ones (verl computes in
    the input dtype)."""
    learner, sampler, mask = batch(dtype=dtype)
    got = gap_metrics(learner, sampler, mask).metrics
    want = verl_reference(learner, sampler, mask)
    assert set(VERL_KEYS) == set(want)
    check_verl(got, want, dtype)


def check_verl(got, want, dtype):
    """Bit for bit on float64 (the correlation, written out, to 1e-12), float32 rounding else."""
    assert got.keys() >= set(want)
    for k in VERL_KEYS:
        if dtype == torch.float64 and k != "training/rollout_actor_probs_pearson_corr":
            assert got[k] == want[k], k
        elif dtype == torch.float64:
            assert got[k] == pytest.approx(want[k], rel=1e-12), k
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k


def test_verl_names_equal_verls_own_function():
    """The values equal verl's own calculate_debug_metrics on a DataProto of the same tensors
    (verl/utils/debug/metrics.py, run from the files ./dev.sh installs beside the venv:
    tests/services/verl_source.py)."""
    if not verl_source.available():
        pytest.skip(f"no verl at {verl_source.VERL_DIR}: ./dev.sh test installs it")
    calculate_debug_metrics = verl_source.debug_metrics()

    for dtype in (torch.float64, torch.float32):
        learner, sampler, mask = batch(b=6, t=24, dtype=dtype, seed=3)
        data = verl_source.DataProto.from_dict({
            "old_log_probs": learner, "rollout_log_probs": sampler,
            "response_mask": mask.to(torch.int64), "responses": torch.zeros(6, 24, dtype=torch.long)})
        want = calculate_debug_metrics(data)
        check_verl(gap_metrics(learner, sampler, mask).metrics, want, dtype)


def test_verl_std_of_one_token_is_nan_like_torch_std():
    """One valid token: verl's torch.std is NaN (one degree of freedom), and so is ours."""
    got = gap_metrics(torch.tensor([-1.0]), torch.tensor([-1.1])).metrics
    assert math.isnan(got["training/rollout_probs_diff_std"])
    assert got["training/rollout_probs_diff_max"] == pytest.approx(abs(math.exp(-1) - math.exp(-1.1)))


# --- the values: slime and libalign ---------------------------------------------------------


def slime_reference(old, rollout, mask):
    """A copy of slime's train_rollout_logprob_abs_diff (slime/backends/megatron_utils/loss.py:
    ``sum_of_sample_mean((old_log_probs - rollout_log_probs).abs())``, with cp_utils'
    ``get_sum_of_sample_mean``: per sample ``(x_i * mask_i).sum() / clamp_min(mask_i.sum(), 1)``,
    summed), divided by the number of samples as slime's step log reports it."""
    x = (old - rollout).abs()
    per = [(xi * mi).sum() / torch.clamp_min(mi.sum(), 1) for xi, mi in zip(x, mask.double(), strict=True)]
    return float(sum(per) / len(per))


@pytest.mark.parametrize("empty_row", [False, True])
def test_slime_name_equals_slimes_formula(empty_row):
    """train_rollout_logprob_abs_diff is slime's mean of per-sample masked means; a sample
    without valid tokens counts as 0, as slime's clamp_min(·, 1) makes it."""
    learner, sampler, mask = batch(b=5, t=20, seed=7, empty_row=empty_row)
    got = gap_metrics(learner, sampler, mask).metrics[SLIME_ABS_DIFF]
    assert got == pytest.approx(slime_reference(learner, sampler, mask), rel=1e-12)


def test_list_layout_gives_the_same_values_as_padded():
    """One tensor per sequence (slime's layout) gives the values of the padded, masked batch."""
    learner, sampler, mask = batch(seed=2)
    padded = gap_metrics(learner, sampler, mask).metrics
    rows = gap_metrics([lp[m] for lp, m in zip(learner, mask, strict=True)],
                       [sp[m] for sp, m in zip(sampler, mask, strict=True)]).metrics
    assert rows == padded


def test_libalign_keys_are_delta_stats_and_tis():
    """The libalign/ keys are DeltaStats' fields and the token-level TIS truncated fraction."""
    learner, sampler, mask = batch(seed=4)
    learner[0, 0] = sampler[0, 0] + 1.5  # a token above the TIS cap
    got = gap_metrics(learner, sampler, mask).metrics
    d = token_deltas(learner, sampler, mask)
    stats = delta_stats(d, mask)
    for k, v in stats.to_dict().items():
        assert got[f"libalign/{k}"] == v
    assert got["libalign/tis_truncated_fraction"] == tis_weights(d, mask).truncated_fraction > 0


@pytest.mark.parametrize(("args", "err"), [
    ((torch.zeros(2, 3) - 1, torch.zeros(2, 4) - 1), ShapeError),
    ((torch.tensor([[-1.0, float("nan")]]), torch.tensor([[-1.0, -1.0]])), NonFiniteError),
    ((torch.tensor([[-1.0, 0.5]]), torch.tensor([[-1.0, -1.0]])), InputError),
])
def test_bad_input_raises_typed_errors_and_exports_nothing(args, err):
    """Mismatched shapes, NaN and a log-prob above 0 raise libalign.metrics' typed errors;
    nothing reaches the registry."""
    mon = Monitor()
    with pytest.raises(err):
        mon.observe(*args)
    assert mon.metrics.value("libalign_logprob_abs_delta_count",
                             {"learner_path": "bf16", "sampler_path": "nvfp4_minite"}) == 0



def test_an_all_masked_batch_is_logged_as_the_peers_log_it():
    """No valid token: slime's mean |δ| 0 (slime/utils: clamp_min(·, 1) per sequence), verl's
    keys as verl's calculate_debug_metrics answers an all-False mask (valid 0, the rest NaN),
    libalign/count 0; nothing exported, and the layouts are still checked."""
    mon = Monitor()
    lp = -torch.rand(2, 5)
    got = mon.observe(lp, lp - 0.1, torch.zeros(2, 5, dtype=torch.bool))
    assert got[SLIME_ABS_DIFF] == 0.0 and got[VERL_KEYS[0]] == 0.0 and got["libalign/count"] == 0
    assert all(math.isnan(got[k]) for k in VERL_KEYS[1:]) and len(got) == 2 + len(VERL_KEYS)
    if verl_source.available():  # verl's own answer, key for key
        want = verl_source.debug_metrics()(verl_source.DataProto.from_dict({
            "old_log_probs": lp, "rollout_log_probs": lp - 0.1,
            "response_mask": torch.zeros(2, 5, dtype=torch.int64),
            "responses": torch.zeros(2, 5, dtype=torch.long)}))
        assert set(want) == set(VERL_KEYS) and want[VERL_KEYS[0]] == got[VERL_KEYS[0]]
        assert all(math.isnan(want[k]) for k in VERL_KEYS[1:])
    assert mon.metrics.value("libalign_logprob_abs_delta_count",
                             {"learner_path": "bf16", "sampler_path": "nvfp4_minite"}) == 0
    again = mon.observe([torch.zeros(0)], [torch.zeros(0)])
    assert again.keys() == got.keys() and again[SLIME_ABS_DIFF] == 0.0
    with pytest.raises(ShapeError):
        mon.observe(lp, lp[:, :4], torch.zeros(2, 5, dtype=torch.bool))
    mon.close()


# --- Prometheus -------------------------------------------------------------------------------


def test_metrics_land_on_the_registry_under_libaligns_names():
    """observe adds every valid |δ| to libalign_logprob_abs_delta and sets the four gap gauges,
    labelled by the monitor's execution paths."""
    learner, sampler, mask = batch(seed=5)
    mon = Monitor(learner_path="bf16", sampler_path="nvfp4_trace")
    got = mon.observe(learner, sampler, mask)
    labels = {"learner_path": "bf16", "sampler_path": "nvfp4_trace"}
    n = int(mask.sum())
    d = (learner - sampler)[mask].abs()
    assert mon.metrics.value("libalign_logprob_abs_delta_count", labels) == n
    assert mon.metrics.value("libalign_logprob_abs_delta_sum", labels) == pytest.approx(float(d.sum()))
    assert mon.metrics.value("libalign_logprob_abs_delta_bucket", {**labels, "le": "0.01"}) == \
        int((d <= 0.01).sum())
    assert mon.metrics.value("libalign_discrepancy_p99_abs", labels) == got["libalign/p99_abs"]
    assert mon.metrics.value("libalign_discrepancy_mean_abs", labels) == got["libalign/mean_abs"]
    assert mon.metrics.value("libalign_clip_potential_ratio", labels) == got["libalign/clip_potential"]
    assert mon.metrics.value("libalign_tis_truncated_ratio", labels) == \
        got["libalign/tis_truncated_fraction"]


# --- the push ---------------------------------------------------------------------------------


@pytest.fixture
def daemon(redis_url, tmp_path):
    """A store with version v1 published and registered in Redis, and the API app (not served)."""
    store = tmp_path / "store"
    bus = RedisBus(connect(redis_url))
    publish_version(store / "published", Registry(bus, "libalign"), bus,
                    event_stream("libalign", "published"), "v1", tiny_experts(2, 16, 32))
    app = create_app(api_settings(redis_url, store, max_body_bytes=4 << 20), redis_give_up_s=0.3)
    return type("Daemon", (), dict(store=store, app=app, redis_url=redis_url, bus=bus))


def test_push_never_blocks_a_step_and_lands_once_the_api_is_back(daemon):
    """With the API unreachable 20 steps (observe + queueing the push) return, the failed
    attempts are counted; once the API serves, every queued batch is delivered and the daemon
    holds its rollouts and δ. (That a step never waits on a push is pinned, without a clock, by
    :func:`test_observe_returns_while_a_push_hangs`.)"""
    port = free_port()
    mon = Monitor(api=f"http://127.0.0.1:{port}", token=TOKEN, retry=FAST, run_id="t")
    learner, sampler, mask = batch(b=8, t=64, seed=6)
    completions = torch.randint(0, 1000, (8, 64))
    for step in range(20):
        mon.observe(learner, sampler, mask, version="v1", step=step, completions=completions,
                    prompts=[[1, 2]] * 8)
    deadline = time.monotonic() + 10
    while mon.metrics.value("libalign_integration_push_retries_total") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert mon.metrics.value("libalign_integration_pushes_total", {"outcome": "delivered"}) == 0
    with serve(daemon.app, port) as url:
        assert mon.flush(60)
        assert mon.metrics.value("libalign_integration_pushes_total", {"outcome": "delivered"}) == 20
        with AlignClient(url, token=TOKEN) as api:
            ids = api.get_rollouts("v1").rollout_ids
            assert len(ids) == 160 and "t-000019-00007" in ids
            disc = api.get_discrepancy("v1", window_tokens=100_000)
            assert disc.stats.count == 20 * int(mask.sum())
            assert disc.stats.max_abs == pytest.approx(float((learner - sampler)[mask].abs().max()),
                                                       rel=1e-6)
    mon.close()


def test_observe_returns_while_a_push_hangs():
    """A daemon that answers one byte a second (a push takes minutes): 5 steps return while
    the push thread is still inside its first call, so no push has an outcome yet (delivered,
    retried or dropped) and the batches wait in the queue. A step that waited on its push would
    have returned only once that call had ended. When the daemon goes away the push call fails
    at once and ``close`` joins the push thread."""
    learner, sampler, mask = batch(b=4, t=16, seed=8)
    drip = Drip(interval_s=1.0)
    with drip:
        mon = Monitor(api=drip.url, token=TOKEN, retry=FAST, run_id="h", timeout_s=600.0)
        for step in range(5):
            mon.observe(learner, sampler, mask, version="v1", step=step)
        outcomes = mon.metrics.value("libalign_integration_pushes_total", {"outcome": "delivered"})
        retries = mon.metrics.value("libalign_integration_push_retries_total")
        assert outcomes == 0 and retries == 0 and drip.drip_s > 60
    assert mon.close(timeout_s=0.0) is True


def test_a_full_queue_drops_and_counts_without_blocking():
    """A bounded queue: with the API down, batches beyond the queue are dropped and counted;
    closing abandons the rest (counted) within its timeout; observe never raises."""
    mon = Monitor(api=f"http://127.0.0.1:{free_port()}", push_queue=2,
                  retry=RetryPolicy(initial_s=1.0, max_s=1.0, attempts=100))
    learner, sampler, mask = batch(seed=8)
    for step in range(10):
        mon.observe(learner, sampler, mask, version="v1", step=step,
                    rollout_ids=[f"r{step}-{i}" for i in range(4)])
    dropped = mon.metrics.value("libalign_integration_pushes_total", {"outcome": "dropped"})
    assert 7 <= dropped <= 8
    t0 = time.perf_counter()
    mon.close(timeout_s=0.5)
    assert time.perf_counter() - t0 < 5
    deadline = time.monotonic() + 10
    while mon.metrics.value("libalign_integration_pushes_total", {"outcome": "abandoned"}) < \
            10 - dropped:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert mon.metrics.value("libalign_integration_pushes_total", {"outcome": "delivered"}) == 0


def test_bounded_retries_abandon_and_a_refused_batch_is_rejected(daemon):
    """Retries are bounded (a batch is abandoned after its attempts); a batch the API refuses
    (unknown version, or scores for rollouts it does not hold) is rejected, never retried."""
    mon = Monitor(api=f"http://127.0.0.1:{free_port()}",
                  retry=RetryPolicy(initial_s=0.01, max_s=0.01, attempts=3))
    learner, sampler, mask = batch(seed=9)
    mon.observe(learner, sampler, mask, version="v1", rollout_ids=list("abcd"))
    assert mon.flush(10)
    assert mon.metrics.value("libalign_integration_pushes_total", {"outcome": "abandoned"}) == 1
    assert mon.metrics.value("libalign_integration_push_retries_total") == 2
    mon.close()
    with serve(daemon.app) as url, Monitor(api=url, token=TOKEN, retry=FAST) as mon:
        mon.observe(learner, sampler, mask, version="nope", rollout_ids=list("abcd"))
        mon.observe(learner, sampler, mask, version="v1", rollout_ids=list("abcd"))
        assert mon.flush(30)
        assert mon.metrics.value("libalign_integration_pushes_total", {"outcome": "rejected"}) == 2
        assert mon.metrics.value("libalign_integration_push_retries_total") == 0


@pytest.mark.parametrize("before", [True, False], ids=["500-before-running", "500-answer-lost"])
def test_a_500_then_200_daemon_gets_every_batch_delivered(daemon, before):
    """Every batch's first scores request answers 500 (before the daemon ran it, or after, its
    answer lost): all 20 batches are delivered on their retry (20 retries, none rejected), and
    the daemon counts each token once."""
    app = FailSome(daemon.app, lambda method, path, n: path.endswith("/scores") and n % 2 == 1,
                   before=before)
    learner, sampler, mask = batch(b=4, t=16, seed=11)
    completions = torch.randint(0, 1000, (4, 16))
    with serve(app) as url, Monitor(api=url, token=TOKEN, retry=FAST, run_id="f") as mon:
        for step in range(20):
            mon.observe(learner, sampler, mask, version="v1", step=step, completions=completions,
                        prompts=[[1, 2]] * 4)
        assert mon.flush(60)
        outcomes = {o: mon.metrics.value("libalign_integration_pushes_total", {"outcome": o})
                    for o in ("delivered", "rejected", "abandoned", "dropped")}
        assert outcomes == {"delivered": 20, "rejected": 0, "abandoned": 0, "dropped": 0}
        assert mon.metrics.value("libalign_integration_push_retries_total") == 20 == app.failed
        with AlignClient(url, token=TOKEN) as api:
            assert api.get_discrepancy("v1", window_tokens=100_000).stats.count == \
                20 * int(mask.sum())


def test_the_push_queue_is_bounded_in_bytes():
    """With the API down and a bound of 3.5 batches' bytes, 3 batches are held (the one being
    sent counts) and the other 7 dropped and counted; the bytes gauge says 3 batches; a step
    stays fast; close abandons the held ones and the gauge returns to 0."""
    learner, sampler, mask = batch(b=8, t=64, seed=12)
    mask[:] = True
    completions = torch.randint(0, 1000, (8, 64))
    one = 8 * 64 * (8 + 8 + 8) + 8 * 2 * 8  # two float64 log-probs and a token id; prompts
    mon = Monitor(api=f"http://127.0.0.1:{free_port()}", push_queue_bytes=int(3.5 * one),
                  retry=RetryPolicy(initial_s=1.0, max_s=1.0, attempts=100))
    for step in range(10):
        mon.observe(learner, sampler, mask, version="v1", step=step, completions=completions,
                    prompts=[[1, 2]] * 8)
    assert mon.metrics.value("libalign_integration_pushes_total", {"outcome": "dropped"}) == 7
    assert mon.pusher.held_bytes == 3 * one
    assert mon.metrics.value("libalign_integration_push_queue_bytes") == 3 * one
    assert mon.close(timeout_s=0.2) and not mon.pusher.alive
    assert mon.metrics.value("libalign_integration_pushes_total", {"outcome": "abandoned"}) == 3
    assert mon.metrics.value("libalign_integration_push_queue_bytes") == 0


def test_calls_to_a_dripping_daemon_end_by_the_deadline_and_close_joins(tmp_path):
    """A daemon answering a byte every 0.2 s (over 20 s an answer): with timeout_s=1,
    fetch_guidance and WeightPublisher.publish raise ApiTimeoutError within 5 s each, and
    close() returns True within 5 s with the push thread (caught in a dripping call) ended."""
    learner, sampler, mask = batch(seed=13)
    with Drip("body") as drip:
        assert drip.drip_s > 20
        mon = Monitor(api=drip.url, timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(ApiTimeoutError):
            mon.fetch_guidance("v1", ["r1"])
        assert time.monotonic() - t0 < 5
        pub = WeightPublisher(tmp_path / "store", api=drip.url, timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(ApiTimeoutError):
            pub.publish(tiny_experts(2, 16, 32), "v9")
        assert time.monotonic() - t0 < 5
        accepted = drip.accepted
        mon.observe(learner, sampler, mask, version="v1", rollout_ids=list("abcd"))
        deadline = time.monotonic() + 10
        while drip.accepted == accepted:  # the push thread is in its dripping call
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        assert mon.close(timeout_s=0.2) is True
        assert time.monotonic() - t0 < 5 and not mon.pusher.alive


def registered(registry: Registry, version_id: str) -> bool:
    try:
        registry.get(version_id)
    except VersionNotFoundError:
        return False
    return True


@pytest.mark.parametrize("before", [True, False], ids=["500-before-running", "500-answer-lost"])
def test_publish_again_after_a_500_ends_with_one_version(redis_url, tmp_path, before):
    """The registration answers 500 (before the API ran it, or after, its answer lost) to a
    publisher that does not retry: publish raises InternalError and keeps the directory; the
    same publish again succeeds, ending with one version, one published event, the directory
    it registered and no leftovers. Other tensors under the id raise VersionExistsError naming
    the tensor and change nothing."""
    store, sd = tmp_path / "store", tiny_experts(2, 16, 32)
    settings = api_settings(redis_url, store)
    app = FailSome(create_app(settings, redis_give_up_s=0.3),
                   lambda method, path, n: method == "POST" and path == "/v1/versions" and n == 1,
                   before=before)
    bus = RedisBus(connect(redis_url))
    registry = Registry(bus, "libalign")
    with serve(app) as url, AlignClient(url, token=TOKEN, retries=0) as once:
        pub = WeightPublisher(store, api=once)
        with pytest.raises(InternalError):
            pub.publish(sd, "v2")
        path = WeightStore(store).published_path("v2")
        assert path.is_dir() and registered(registry, "v2") is (not before)
        assert pub.publish(sd, "v2") == "published"
        assert [v.version_id for v in once.list_versions().versions] == ["v2"]
        events = bus.client.xrange(settings.published_stream)
        assert [e[1]["version_id"] for e in events] == ["v2"]
        rec = registry.get("v2")
        assert rec.path == str(path) and rec.meta["publish_id"] == publish_id(path)
        assert sorted(p.name for p in path.parent.iterdir()) == ["v2"]
        other = {k: v + 1 for k, v in sd.items()}
        with pytest.raises(VersionExistsError, match="holds other values"):
            pub.publish(other, "v2")
        assert publish_id(path) == rec.meta["publish_id"]


def test_publish_retries_a_500_itself_and_a_refusal_leaves_nothing(redis_url, tmp_path):
    """With its own client (3 retries), a registration whose answer is lost behind a 500 is
    retried and answered with the version it made: one publish call, one version, one event.
    A refused registration (wrong token, 403) removes the directory the call wrote."""
    store, sd = tmp_path / "store", tiny_experts(2, 16, 32)
    settings = api_settings(redis_url, store)
    app = FailSome(create_app(settings, redis_give_up_s=0.3),
                   lambda method, path, n: method == "POST" and path == "/v1/versions" and n == 1,
                   before=False)
    bus = RedisBus(connect(redis_url))
    registry = Registry(bus, "libalign")
    with serve(app) as url:
        assert WeightPublisher(store, api=url, token=TOKEN).publish(sd, "v3") == "published"
        assert app.failed == 1 and registry.get("v3").state == "published"
        events = bus.client.xrange(settings.published_stream)
        assert [e[1]["version_id"] for e in events] == ["v3"]
        with pytest.raises(ForbiddenError):
            WeightPublisher(store, api=url, token="wrong-token").publish(sd, "v4")
        assert sorted(p.name for p in (store / "published").iterdir()) == ["v3"]
        assert not registered(registry, "v4")


def test_push_arguments_are_checked_in_the_step():
    """Bad push arguments are the caller's mistake and raise at once, typed."""
    mon = Monitor(api=f"http://127.0.0.1:{free_port()}")
    learner, sampler, mask = batch(seed=10)
    with pytest.raises(ShapeError):
        mon.observe(learner, sampler, mask, version="v1", rollout_ids=["a"])
    with pytest.raises(InputError):
        mon.observe(learner, sampler, mask, version="v1", rollout_ids=["a", "b", "c", "a/b"])
    with pytest.raises(InputError):
        mon.observe(learner, sampler, mask, version="v1", completions=torch.zeros(4, 16,
                                                                                  dtype=torch.long))
    mon.close(timeout_s=0.1)


# --- publishing and guidance --------------------------------------------------------------------


def test_publish_from_tensors_converts_here_bit_identical_to_the_converter(redis_url, tmp_path):
    """With Redis, the state dict is converted in-process (no BF16 written), announced as
    converted, and its stored tensors carry the converter's checksums for the same weights."""
    sd = tiny_experts(2, 16, 32)
    pub = WeightPublisher(tmp_path / "store", redis_url=redis_url)
    assert pub.publish(sd, "v1", target_path="nvfp4_minite") == "converted"
    store = WeightStore(tmp_path / "store")
    assert not store.published_path("v1").exists()
    rec = Registry(pub.bus, "libalign").get("v1")
    assert rec.state == "converted"
    ref = WeightStore(tmp_path / "ref")
    src = write_published(tmp_path / "pub", "v1", sd)
    want = convert_published(src, ref, "v1", "minite")
    got = store.verify_version("v1")
    assert {n: e.stored for n, e in got.tensors.items()} == \
        {n: e.stored for n, e in want.tensors.items()}
    last = pub.bus.client.xrevrange(event_stream("libalign", "converted"), count=1)
    assert last and last[0][1]["version_id"] == "v1"


def test_publish_from_tensors_through_the_api(redis_url, tmp_path):
    """With only the API, the integration writes the published version atomically and
    registers it; the converter service takes it from there."""
    store = tmp_path / "store"
    app = create_app(api_settings(redis_url, store), redis_give_up_s=0.3)
    with serve(app) as url:
        pub = WeightPublisher(store, api=url, token=TOKEN)
        assert pub.publish(tiny_experts(2, 16, 32), "v2") == "published"
        with AlignClient(url, token=TOKEN) as api:
            assert api.get_version("v2").version.state == "published"


def test_fetch_guidance_returns_decoded_tensors(daemon):
    """Guidance records come back decoded, keyed by position in the ids asked for."""
    g = torch.Generator().manual_seed(0)
    rows = SiteRows(positions=torch.arange(3, dtype=torch.int32),
                    experts=torch.full((3,), -1, dtype=torch.int16),
                    codes=torch.randint(0, 2, (3, 32), generator=g).to(torch.uint8),
                    block_scales=torch.randint(0, 256, (3, 2), generator=g).to(torch.uint8),
                    row_scales=torch.rand(3, generator=g), k=32)
    rec = GuidanceRecord(1, "minite", {(0, "fc1"): rows})
    with serve(daemon.app) as url, Monitor(api=url, token=TOKEN) as mon:
        mon.api.put_guidance("v1", "r1", rec.encode())
        got = mon.fetch_guidance("v1", ["r0", "r1"], missing="skip")
        assert list(got) == [1]
        back = got[1].sites[(0, "fc1")]
        assert torch.equal(back.codes, rows.codes) and torch.equal(back.row_scales, rows.row_scales)


# --- the README snippets --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["with_verl.py", "with_slime.py"])
def test_readme_snippets_run_and_push(daemon, name, monkeypatch, capsys):
    """docs/snippets/<name> (the README's "With verl" / "With slime" code) runs as written and
    its batch reaches the daemon."""
    with serve(daemon.app) as url:
        monkeypatch.setenv("ALIGN_API_URL", url)
        monkeypatch.setenv("ALIGN_API_TOKEN", TOKEN)
        monkeypatch.setenv("ALIGN_VERSION", "v1")
        runpy.run_path(str(ROOT / "docs" / "snippets" / name), run_name="__main__")
        with AlignClient(url, token=TOKEN) as api:
            assert api.get_discrepancy("v1").stats.count > 0
    out = capsys.readouterr().out
    assert ("training/rollout_probs_diff_mean" if name == "with_verl.py" else SLIME_ABS_DIFF) in out
    assert np.isfinite(float(out.split()[-1])) if name == "with_slime.py" else True
