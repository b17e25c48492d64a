"""Handling of one ``published`` message, idempotently, with ack only when done.

Delivery is at least once, so the same version may arrive twice, or arrive after a
converter died half-way. What a message leads to depends on the version's state:

==============  ==============================================================
``published``   claim (-> ``converting``), convert, -> ``converted``, announce
``converting``  if the message was reclaimed from a dead consumer: re-enter
                ``converting`` under this consumer's name and finish the work;
                otherwise another consumer holds it: skip
``converted``   a predecessor died between recording and acking: announce again
``loading``,    nothing left to do
``serving``,
``failed``,
``retired``
(record gone)   pruned by retention (or never registered): the message is dropped
==============  ==============================================================

Finishing reuses a complete store version if one verifies (the predecessor died after
the rename), and otherwise writes it atomically. With ``sampler_layout=modelopt`` the
version is also written, once, in the layout SGLang samplers load
(:class:`~alignd.formats.modelopt_export.ModelOptExport`, from the store version: nothing
is quantized twice; fused siblings are quantized with one outer maximum for it), before it
becomes ``converted``; a version whose numerics SGLang cannot load (row-scaled, MXFP4,
unquantized: for another sampler path) gets no export. A version converted for a sampler path
with an FP4 KV cache (``nvfp4_minite_kv_*``) names that KV format in its manifest
(``extra["kv"]``: :func:`~alignd.formats.convert.kv_manifest`), with the per-layer global K/V
scales of ``kv_scales_file`` where the format takes them (``kv_sglang_nvfp4``; unset: SGLang's
default 1.0); a sampler refuses a version made for another KV format. Bad input (NaN/Inf, wrong dtype, wrong
shape, missing shard) moves the version to ``failed`` with a reason naming the tensor or
shard; the message is acked and the service goes on. So does a full disk or quota
(``ENOSPC``, ``EDQUOT``): ``no_space`` with the error, its path and the store's free bytes;
once space is freed an operator retries the version. An unexpected error leaves the
message pending, to be reclaimed and tried again, at most ``max_deliveries`` times.
The message is acked only after the version's outcome is recorded in the registry.

A conversion is resumable, never finished at any cost: once the worker's ``stop`` event is set
(the service was told to stop) the conversion in progress is abandoned before its next
tensor (:class:`ConversionStopped`): the staging directory is removed, the message is not
acked and the version stays ``converting`` (not failed), so the next converter reclaims the
message after ``claim_idle_ms`` and converts the version again from the start, to the same
bits. A version already renamed into the store is finished (only the registry and the
announcement are left).
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections.abc import Callable

from alignclient.errors import (
    AlignError,
    BusUnavailableError,
    ConfigError,
    EventError,
    InputError,
    StateTransitionError,
    StoreError,
    VersionExistsError,
    VersionNotFoundError,
)

from alignd.formats.convert import (
    convert_published,
    load_kv_scales,
    path_kv_format,
    path_kv_scales,
    resolve_spec,
    target_spec,
)
from alignd.formats.manifest import Manifest
from alignd.formats.modelopt_export import exports_for, holds
from alignd.formats.weight_store import WeightStore
from alignd.infra.bus import ClaimKeeper, Message, RedisBus
from alignd.infra.events import PublishedEvent
from alignd.infra.registry import Registry
from alignd.infra.settings import ConverterSettings
from alignd.infra.telemetry import Metrics
from alignd.sync.announce import converted_event
from libalign.models.kv_cache import KVScales
from libalign.spec import NumericsSpec

log = logging.getLogger(__name__)

#: Errors of a full disk or quota: the version fails at once naming the error and the path (a
#: redelivery would fail the same way until an operator frees space and retries it).
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

#: Versions whose last unexpected error is remembered (the oldest is forgotten first).
MAX_LAST_ERRORS = 256

# Outcomes of handle(); every one but RETRY and STOPPED acks the message.
CONVERTED, FAILED, SKIPPED, DROPPED, RETRY = "converted", "failed", "skipped", "dropped", "retry"
STOPPED = "stopped"


class ConversionStopped(Exception):
    """The service is stopping: the conversion in progress is abandoned, to be redone by the
    converter that reclaims its message (not an error of the version)."""


class ConverterWorker:
    """Turns ``published`` messages into converted (or failed) versions.

    ``on_step`` is called with a label after each durable step of a conversion (a shard
    written, the manifest, the rename, the commit), in the thread that converts. Once
    ``stop`` is set, a conversion in progress stops before its next tensor (STOPPED).
    """

    def __init__(self, settings: ConverterSettings, bus: RedisBus, registry: Registry,
                 store: WeightStore, metrics: Metrics, *,
                 on_step: Callable[[str], None] | None = None,
                 stop: threading.Event | None = None):
        self.settings = settings
        self.on_step = on_step
        self.stop = stop if stop is not None else threading.Event()
        self.bus = bus
        self.registry = registry
        self.store = store
        self.metrics = metrics
        self.spec = resolve_spec(settings.preset)
        self.me = settings.consumer_name
        self.exports = exports_for(settings.sampler_layout, store, settings.sglang_model_dir,
                                   settings.sglang_export_dir,
                                   shard_bytes=settings.store_shard_bytes)
        try:
            self.kv_scales = load_kv_scales(settings.kv_scales_file)
        except AlignError as e:
            raise ConfigError(f"kv_scales_file: {e}") from None
        #: version id -> the unexpected error of its last delivery here (said when giving up)
        self.last_errors: dict[str, str] = {}

    def handle(self, msg: Message) -> str:
        """Process one message; ack it unless the outcome is RETRY. Returns the outcome."""
        try:
            outcome = self._process(msg)
        except ConversionStopped as e:
            log.info("message %s: %s; left pending for the converter that reclaims it",
                     msg.id, e)
            return STOPPED
        except BusUnavailableError:
            raise
        except Exception as e:
            log.exception("message %s: unexpected error; left pending for a retry", msg.id)
            if len(self.last_errors) >= MAX_LAST_ERRORS:
                self.last_errors.pop(next(iter(self.last_errors)))
            self.last_errors[str(msg.fields.get("version_id", ""))] = f"{type(e).__name__}: {e}"
            return RETRY
        self.last_errors.pop(str(msg.fields.get("version_id", "")), None)
        self.bus.ack(msg.stream, self.settings.converter_group, msg.id)
        return outcome

    def _process(self, msg: Message) -> str:
        """Decide by the version's state what the message still needs."""
        try:
            event = PublishedEvent.from_fields(msg.fields)
        except (EventError, InputError) as e:
            log.error("message %s dropped: %s", msg.id, e)
            self.metrics.observe_failure(e)
            return DROPPED
        vid = event.version_id
        try:
            rec = self.registry.get(vid)
        except VersionNotFoundError as e:
            log.error("message %s dropped: %s", msg.id, e)
            self.metrics.observe_failure(e)
            return DROPPED
        if rec.state == "converted":
            try:
                self._announce(vid, target_path=event.target_path)
            except (VersionNotFoundError, StoreError) as e:  # store copy deleted since
                log.error("version %s is converted but cannot be announced: %s", vid, e)
            return SKIPPED
        if rec.state not in ("published", "converting"):
            log.info("version %s is %s already; nothing to do", vid, rec.state)
            return SKIPPED
        if msg.deliveries > self.settings.max_deliveries:
            last = self.last_errors.get(vid)
            return self._fail(vid, "too_many_deliveries",
                              f"gave up after {msg.deliveries - 1} deliveries"
                              + (f"; the last one here failed with {last}" if last else ""),
                              fence=False)
        try:
            self.registry.transition(vid, "converting", actor=self.me, reclaim=msg.reclaimed)
        except StateTransitionError as e:
            log.info("version %s: %s; another consumer holds it", vid, e)
            return SKIPPED
        t0 = time.perf_counter()
        self.metrics.converter_busy.set(1)
        try:
            with ClaimKeeper(self.bus, msg, self.settings.converter_group, self.me,
                           self.settings.heartbeat_ms / 1000):
                manifest = self._convert(vid, rec.path or event.path, event.target_path)
        except (InputError, StoreError) as e:
            return self._fail(vid, e.code, str(e), err=e)
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise  # maybe transient: left pending, tried again
            return self._fail(vid, "no_space", self._no_space_detail(e), err="no_space")
        finally:
            self.metrics.converter_busy.set(0)
        try:
            self.registry.transition(vid, "converted", actor=self.me, expect_owner=self.me)
        except StateTransitionError as e:
            log.warning("version %s: %s; another consumer finished it", vid, e)
            return SKIPPED
        self.metrics.observe_conversion(manifest, time.perf_counter() - t0)
        self._announce(vid, manifest, event.target_path)
        log.info("version %s converted: %d tensors, %d bytes, %.2fs", vid,
                 manifest.totals.tensors, manifest.totals.stored_bytes,
                 time.perf_counter() - t0)
        return CONVERTED

    def _convert(self, vid: str, src: str, target_path: str | None = None) -> Manifest:
        """The store version of ``vid``: reused if complete and verified, else written."""
        spec, quantize = target_spec(self.spec, target_path)
        overwrite = False
        if self.store.has_version(vid):
            try:
                manifest = self.store.verify_version(vid)
                log.info("version %s: reusing the verified store version", vid)
                self._export(vid, spec, quantize)
                return manifest
            except StoreError as e:
                log.warning("version %s: store copy is bad (%s); rewriting it", vid, e)
                overwrite = True
        try:
            manifest = convert_published(
                src, self.store, vid, spec, all_linear=self.settings.convert_all_linear,
                quantize=quantize, share_fused=self.exports is not None,
                device=self.settings.converter_device,
                shard_bytes=self.settings.store_shard_bytes, overwrite=overwrite, on_step=self._step,
                on_tensor=lambda name: self._stop_here(vid, name),
                kv_format=path_kv_format(target_path), kv_scales=self._kv_scales(target_path))
        except VersionExistsError:  # a concurrent converter committed first
            manifest = self.store.verify_version(vid)
        self._step("committed")
        self._export(vid, spec, quantize)
        return manifest

    def _kv_scales(self, target_path: str | None) -> KVScales | None:
        """The K/V global scales a version for ``target_path`` names: the configured ones
        (``kv_scales_file``) when the path's KV format takes them, else None."""
        return path_kv_scales(target_path, self.kv_scales)

    def _export(self, vid: str, spec: NumericsSpec, quantize: bool) -> None:
        """The version in the samplers' layout too (``sampler_layout=modelopt``), if SGLang can
        load its numerics; idempotent (an export already there is kept)."""
        if self.exports is None:
            return
        if not holds(spec, quantize):
            log.info("version %s (%s) is not for an SGLang sampler; no ModelOpt export", vid,
                     spec.name if quantize else "bf16")
            return
        manifest = self.exports.write(vid)
        self._step("exported")
        log.info("version %s exported for SGLang: %s (%d tensors, %.2fs)", vid,
                 self.exports.path(vid), manifest["tensors_converted"], manifest["seconds"])

    def _no_space_detail(self, e: OSError) -> str:
        """A full disk (or quota) named: the error with its path, and the store's free bytes."""
        where = f"store {self.store.root}"
        try:
            usage = shutil.disk_usage(self.store.root)
            where += f": {usage.free} of {usage.total} bytes free"
        except OSError:
            pass
        return f"{e} ({where}); free space, then retry the version (POST /v1/versions/<id>:retry)"

    def _stop_here(self, vid: str, tensor: str) -> None:
        """Before each tensor: abandon the conversion if the service is stopping."""
        if self.stop.is_set():
            raise ConversionStopped(f"stopping: conversion of {vid} abandoned before tensor "
                                    f"{tensor!r}, its staging directory removed")

    def _step(self, label: str) -> None:
        """After each durable step of a conversion: log it, tell ``on_step``."""
        log.debug("step: %s", label)
        if self.on_step is not None:
            self.on_step(label)

    def _fail(self, vid: str, code: str, detail: str, *, err: BaseException | None = None,
              fence: bool = True) -> str:
        """Record ``failed`` with a reason; count it. SKIPPED if another consumer took over."""
        reason = f"{code}: {detail}"
        try:
            self.registry.fail(vid, reason, actor=self.me, expect_owner=self.me if fence else None)
        except StateTransitionError as e:
            log.warning("version %s: could not record failure (%s)", vid, e)
            return SKIPPED
        self.metrics.observe_failure(err if err is not None else code)
        log.error("version %s failed: %s", vid, reason)
        return FAILED

    def _announce(self, vid: str, manifest: Manifest | None = None,
                  target_path: str | None = None) -> None:
        """Put a ``converted`` event for ``vid`` on the converted stream."""
        spec, _ = target_spec(self.spec, target_path)
        event = converted_event(self.store, vid, spec.name, manifest=manifest,
                                target_path=target_path)
        self.bus.publish(self.settings.converted_stream, event.to_fields())
