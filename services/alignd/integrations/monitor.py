"""What a slime or verl trainer calls inside its loop: :class:`Monitor` and :class:`WeightPublisher`.

The trainer already holds both log-probability tensors of every batch; nothing needs to go
through JSON to measure the gap. :meth:`Monitor.observe` computes it in-process
(:func:`~alignd.integrations.gap.gap_metrics`), returns one dict to hand to the trainer's own
logger (slime's and verl's names beside libalign's), updates the Prometheus families under
libalign's names on the trainer's registry (:class:`~alignd.infra.telemetry.TrainerMetrics`),
and, given a version, queues the batch for the daemon (:class:`~alignd.integrations.push
.ScorePusher`), which sends it in the background: the step never waits for, nor fails because
of, the daemon. :meth:`Monitor.fetch_guidance` reads TRACE guidance records back as decoded
tensors (:class:`libalign.guidance.GuidanceRecord`), keyed by position in the batch as the
learner's scoring takes them.

Routing records (the sampler's chosen experts per token) are not in the daemon's stores yet,
so there is nothing to fetch for them here.

Publishing weights (:class:`WeightPublisher`). The trainer hands its state dict (any mapping or
iterable of ``(name, tensor)``; tensors on any device):

* with Redis (``redis_url``, or a ``bus``), the version is converted right here, by the
  converter's own code path (:meth:`~alignd.formats.weight_store.WeightStore.write_version`
  under the target path's spec and the converter's selection), written atomically into the
  store's NVFP4 directory and announced as ``converted`` (the registry walks ``published →
  converting → converted``, :func:`alignd.sync.announce.announce_converted`, the
  same step the expert-parallel learner takes): no BF16 checkpoint is ever written, and the
  samplers load it as soon as they see the event. ``device="cuda"`` quantizes on the GPU the
  tensors live on; the stored bits are the same on every device;
* with only the control API (``api``), the BF16 version is written by the integration into
  the store's published directory through the one atomic writer
  (:func:`alignd.formats.published.write_published`) and registered with
  ``POST /v1/versions``; the converter service converts it. The API has no route that takes
  tensors (a multi-GB body through the front door would be the wrong transport), so this is
  the path for a trainer that can see the store but not Redis.

  Publishing this way may simply be called again when it fails. Registration is retried
  within the client's deadline (a 500 or a lost answer included: the API answers a repeated
  registration of the same directory with the version it made). If it still fails, the
  directory stays when the daemon may have registered it (it could not be reached, or
  answered 5xx), and a later ``publish`` of the same id with the same tensors finds it,
  checks that it holds exactly those bytes (:func:`alignd.formats.published.differs_from`)
  and registers it, ending with one version; other tensors under the same id raise
  ``VersionExistsError`` naming the first difference. When the daemon refused the version
  (a 4xx) the directory this call wrote is removed again, so nothing is left that no
  version owns.

Bounded calls. Every call to the daemon made here, on the training thread or on the push
thread, ends within ``timeout_s`` (the client's total deadline, :mod:`alignclient.deadline`),
however slowly the daemon answers; an answer that does not follow the contract raises
:class:`~alignclient.errors.BadResponseError` naming the route and the field.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from alignclient import AlignClient
from alignclient.errors import AlignError, DTypeError, InputError, ShapeError, VersionExistsError
from alignclient.ids import check_rollout_id
from alignclient.retry import RetryPolicy, refused
from prometheus_client import CollectorRegistry

from alignd.formats.convert import kv_manifest, path_kv_format, resolve_spec, target_spec
from alignd.formats.published import differs_from, write_published
from alignd.formats.selection import make_select
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import RedisBus, connect
from alignd.infra.events import DEFAULT_KEY_PREFIX, event_stream
from alignd.infra.registry import Registry
from alignd.infra.telemetry import TrainerMetrics
from alignd.integrations.gap import BatchGap, gap_metrics
from alignd.integrations.push import (
    DEFAULT_PUSH_QUEUE_BATCHES,
    DEFAULT_PUSH_QUEUE_BYTES,
    DEFAULT_PUSH_RETRY,
    PushBatch,
    ScorePusher,
    as_prompts,
    split_rows,
)
from alignd.sync.announce import announce_converted
from libalign.atomic_dir import discard_directory
from libalign.guidance import GuidanceRecord
from libalign.metrics import DEFAULT_TIS_CAP, TISWeights, TokenInput, tis_weights, token_deltas

log = logging.getLogger(__name__)


def _client(api: AlignClient | str | None, token: str | None, timeout_s: float,
            retries: int = 0) -> AlignClient | None:
    """A client of ``api`` whose every call ends within ``timeout_s`` (a URL), or None; a
    client given is used as it is."""
    if api is None or isinstance(api, AlignClient):
        return api
    return AlignClient(api, token=token, timeout=timeout_s, retries=retries,
                       max_backoff_s=min(5.0, timeout_s / 4), deadline_s=timeout_s)


def _valid_rows(x: TokenInput, mask: torch.Tensor | None, n_seq: int, name: str
                ) -> list[torch.Tensor]:
    """The valid entries of an integer tensor (or list) laid out like the log-probs, per row."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise DTypeError(f"{name} must hold integer token ids, got {x.dtype}")
        rows = x.reshape(n_seq, -1)
        if mask is None:
            return list(rows.detach().cpu())
        m = mask.reshape(n_seq, -1)
        if m.shape != rows.shape:
            raise ShapeError(f"{name} has shape {tuple(x.shape)} but mask has {tuple(mask.shape)}")
        return [r[k].detach().cpu() for r, k in zip(rows, m.to(rows.device), strict=True)]
    out = [torch.as_tensor(t).detach().cpu() for t in x]
    if len(out) != n_seq:
        raise ShapeError(f"{name} has {len(out)} sequences but the log-probs have {n_seq}")
    return out


class Monitor:
    """The gap of each training batch, exported, logged and pushed (see the module doc).

    ``registry`` is where the Prometheus families go (a fresh one when None; the trainer
    serves it, e.g. with :func:`alignd.infra.telemetry.serve_metrics`). ``api`` (a URL or an
    :class:`~alignclient.AlignClient`) enables the background push, holding at most
    ``push_queue`` batches and ``push_queue_bytes`` bytes of them (256 MiB by default; a batch
    past either bound is dropped and counted). A URL gets a client whose every call ends within
    ``timeout_s``. ``learner_path``/``sampler_path`` label the metrics and the pushed rollouts
    and scores (execution path names of :data:`libalign.gemm.PATHS`).
    """

    def __init__(self, registry: CollectorRegistry | None = None, api: AlignClient | str | None = None,
                 token: str | None = None, *, push_queue: int = DEFAULT_PUSH_QUEUE_BATCHES,
                 push_queue_bytes: int = DEFAULT_PUSH_QUEUE_BYTES, learner_path: str = "bf16",
                 sampler_path: str = "nvfp4_minite", tis_cap: float = DEFAULT_TIS_CAP,
                 retry: RetryPolicy = DEFAULT_PUSH_RETRY, timeout_s: float = 10.0,
                 run_id: str | None = None):
        self.metrics = TrainerMetrics(registry)
        self.registry = self.metrics.registry
        self.api = _client(api, token, timeout_s)
        self.learner_path, self.sampler_path = learner_path, sampler_path
        self.tis_cap = tis_cap
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self._batches = itertools.count()
        self.pusher = (ScorePusher(self.api, self.metrics, queue_size=push_queue,
                                   queue_bytes=push_queue_bytes, retry=retry)
                       if self.api is not None else None)

    def observe(self, learner_logp: TokenInput, sampler_logp: TokenInput,
                mask: torch.Tensor | None = None, *, version: str | None = None,
                step: int | None = None, rollout_ids: Sequence[str] | None = None,
                completions: TokenInput | None = None, prompts: Sequence | None = None
                ) -> dict[str, float]:
        """The batch's gap as a dict of floats; exported now, pushed in the background.

        Bad input raises :mod:`libalign.metrics`'s typed errors before anything is exported.
        With ``version`` and an API, the batch is queued for the daemon: ``completions`` (the
        completion token ids laid out like the log-probs) and ``prompts`` (each rollout's
        prompt ids) store the rollouts first, for a trainer whose own engine generated them;
        without them, ``rollout_ids`` name rollouts the daemon already holds. Rollout ids
        default to ``<run_id>-<step>-<row>``. A row without valid tokens is not pushed.
        """
        gap = gap_metrics(learner_logp, sampler_logp, mask, cap=self.tis_cap)
        if gap.stats is None or gap.tis is None:  # no valid token: logged as 0, nothing else
            return dict(gap.metrics)
        self.metrics.observe_gap(self.learner_path, self.sampler_path, gap.delta.abs().cpu().numpy(),
                                 mean_abs=gap.stats.mean_abs, p99_abs=gap.stats.p99_abs,
                                 clip_potential=gap.stats.clip_potential,
                                 tis_truncated=gap.tis.truncated_fraction)
        if version is not None and self.pusher is not None:
            self.pusher.submit(self._batch(gap, mask, version, step, rollout_ids, completions,
                                           prompts))
        return dict(gap.metrics)

    def _batch(self, gap: BatchGap, mask, version: str, step: int | None,
               rollout_ids: Sequence[str] | None, completions: TokenInput | None,
               prompts: Sequence | None) -> PushBatch:
        n = gap.n_seq
        tag = step if step is not None else next(self._batches)
        ids = list(rollout_ids) if rollout_ids is not None else \
            [f"{self.run_id}-{tag:06d}-{i:05d}" for i in range(n)]
        if len(ids) != n:
            raise ShapeError(f"rollout_ids has {len(ids)} entries but the batch has {n} sequences")
        for r in ids:
            check_rollout_id(r)
        learner = split_rows(gap.learner, gap.seq, n)
        sampler = split_rows(gap.sampler, gap.seq, n)
        comp = plist = None
        if completions is not None:
            if prompts is None:
                raise InputError("completions need prompts: a stored rollout is its prompt "
                                 "and its completion")
            comp = _valid_rows(completions, mask, n, "completions")
            plist = as_prompts(prompts, n)
            for i, (c, lp) in enumerate(zip(comp, learner, strict=True)):
                if c.numel() != lp.numel():
                    raise ShapeError(f"completions row {i} has {c.numel()} valid tokens but the "
                                     f"log-probs have {lp.numel()}")
        keep = [i for i in range(n) if learner[i].numel() > 0]
        return PushBatch(version, [ids[i] for i in keep], [learner[i] for i in keep],
                         [sampler[i] for i in keep], self.learner_path, self.sampler_path,
                         None if comp is None else [comp[i] for i in keep],
                         None if plist is None else [plist[i] for i in keep])

    def tis_weights(self, learner_logp: TokenInput, sampler_logp: TokenInput,
                    mask: torch.Tensor | None = None, *,
                    level: Literal["token", "sequence", "geometric"] = "token",
                    cap: float | None = None) -> TISWeights:
        """Truncated importance weights of the batch (:func:`libalign.metrics.tis_weights`)."""
        d = token_deltas(learner_logp, sampler_logp, mask)
        return tis_weights(d, mask, cap=self.tis_cap if cap is None else cap, level=level)

    def fetch_guidance(self, version: str, rollout_ids: Sequence[str], *,
                       device: torch.device | str = "cpu",
                       missing: Literal["raise", "skip"] = "raise") -> dict[int, GuidanceRecord]:
        """The rollouts' guidance records, decoded onto ``device``, keyed by their position in
        ``rollout_ids`` (the sequence ids :class:`libalign.guidance.GuidanceTable` takes)."""
        if self.api is None:
            raise InputError("fetch_guidance needs the control API: give Monitor(api=...)")
        blobs = self.api.get_guidance_batch(version, list(rollout_ids), missing=missing)
        return {i: GuidanceRecord.decode(blobs[r], device, what=f"guidance of {version}/{r}")
                for i, r in enumerate(rollout_ids) if r in blobs}

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued pushes to land (or be given up); True if the queue drained."""
        return True if self.pusher is None else self.pusher.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Give queued pushes ``timeout_s``, stop the push thread and wait for it (at most the
        client's deadline more), close the client. True when the push thread has ended; False
        (logged) when it had to be abandoned still running."""
        ended = True
        if self.pusher is not None:
            ended = self.pusher.close(timeout_s)
        if self.api is not None:
            self.api.close()
        return ended

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WeightPublisher:
    """Publish weight versions from in-memory tensors (see the module doc for the two routes).

    ``store_dir`` is the weight store the daemon uses (``ALIGN_STORE_DIR``). Give ``redis_url``
    (or a ``bus``) to convert here and announce the version as converted; give only ``api`` to
    write the BF16 version for the converter service (a URL gets a client that retries the
    registration ``retries`` times, all within ``timeout_s``).
    """

    def __init__(self, store_dir: Path | str, *, api: AlignClient | str | None = None,
                 token: str | None = None, redis_url: str | None = None,
                 bus: RedisBus | None = None, key_prefix: str = DEFAULT_KEY_PREFIX,
                 timeout_s: float = 60.0, retries: int = 3):
        if bus is None and redis_url is not None:
            bus = RedisBus(connect(redis_url))
        if bus is None and api is None:
            raise InputError("WeightPublisher needs redis_url (convert here) or api (publish "
                             "BF16 for the converter service)")
        self.store = WeightStore(Path(store_dir))
        self.bus = bus
        self.key_prefix = key_prefix
        self.api = _client(api, token, timeout_s, retries)

    def publish(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                version_id: str, *, target_path: str | None = None, preset: str = "minite",
                all_linear: bool = False, device: str = "cpu",
                meta: Mapping[str, object] | None = None) -> str:
        """Publish ``tensors`` as ``version_id``; returns the state it reached (``converted``
        when converted here, ``published`` when left to the converter service)."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        if self.bus is None:
            self._publish_bf16(items, version_id, target_path, meta)
            return "published"
        spec, quantize = target_spec(resolve_spec(preset), target_path)
        extra = {"all_linear": all_linear, "quantized": quantize}
        kv = kv_manifest(path_kv_format(target_path))  # the KV format a sampler checks
        if kv is not None:
            extra["kv"] = kv
        self.store.write_version(
            version_id, items, spec,
            select=make_select(all_linear) if quantize else (lambda name, t: False),
            source={"kind": "tensors"}, extra=extra, device=device)
        announce_converted(Registry(self.bus, self.key_prefix), self.bus,
                           event_stream(self.key_prefix, "converted"), self.store, version_id,
                           spec.name, target_path=target_path, actor="trainer")
        return "converted"

    def _publish_bf16(self, items, version_id: str, target_path: str | None,
                      meta: Mapping[str, object] | None) -> None:
        """Write the BF16 version (or find this very version left by an earlier attempt) and
        register it; remove what this call wrote when the daemon refuses it (module doc)."""
        assert self.api is not None
        path = self.store.published_path(version_id)
        wrote = False
        try:
            write_published(self.store.published_root, version_id, items)
            wrote = True
        except VersionExistsError as e:
            why = differs_from(path, items)
            if why is not None:
                raise VersionExistsError(version_id, f"published store ({why})") from e
        try:
            self.api.publish_version(version_id, meta=meta, target_path=target_path)
        except AlignError as e:
            if wrote and refused(e):
                discard_directory(path)
            else:
                log.warning("registering version %s failed (%s: %s); its published directory "
                            "stays, and publishing the same tensors again registers it",
                            version_id, type(e).__name__, e)
            raise
