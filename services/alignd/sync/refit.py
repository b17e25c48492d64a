"""A refit: one weight version from a trainer's named tensors to a server's parameters, in
buckets, with the conversion of one bucket hidden behind the transfer of the one before.

The transports (:mod:`~alignd.sync.tensor`, :mod:`~alignd.sync.distributed`) differ only in
how a bucket crosses to the server; this module is what they share:

1. The named tensors go through :func:`alignd.sync.stream.quantize_named` (``spec`` set: the
   NVFP4 refit) or unchanged (``spec`` None: the BF16 refit of the same tensors, the
   baseline a benchmark compares with), then into buckets (:func:`alignd.sync.buckets.buckets`).
2. Each bucket gets its :class:`~alignd.sync.buckets.RefitHeader` (version, index, and on the
   last one the tensor count and the digest of every entry) and is handed to the transport's
   ``send``. Sends run on one worker thread, one at a time and in order, while the caller's
   thread quantizes and packs the next bucket: at most two buckets exist at once, the one in
   flight and the one being built. A send that fails stops the refit (the next bucket is
   not sent) and its error is raised in the caller.
3. The version is announced to the daemon as a converter-made version is
   (:class:`alignd.sync.announce.RefitStages`): ``published`` and ``converting`` when the
   refit starts, ``converted`` and ``loading`` once every bucket is produced, ``serving``
   once the server confirmed the last, so the registry, staleness and the sync-latency histogram read
   the same whichever way a version travelled. A failure marks it ``failed`` with the reason.

Timing (:class:`RefitReport`): seconds spent producing buckets (quantize and pack, on the
caller's thread), seconds in ``send`` (the worker), and the wall time of the whole refit;
with the overlap the wall time is near the larger of the two, not their sum.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import torch
from alignclient.errors import InputError, WeightUpdateError

from alignd.formats.convert import resolve_spec
from alignd.sync.announce import RefitStages
from alignd.sync.buckets import Bucket, Digest, RefitHeader, ended_buckets
from alignd.sync.fill import filled_buckets, fills
from alignd.sync.stream import DEFAULT_BUCKET_BYTES, quantize_named
from libalign.spec import NumericsSpec

log = logging.getLogger(__name__)

#: ``send(bucket, header)``: hand one bucket to the server; returns once the server holds it.
Send = Callable[[Bucket, RefitHeader], None]


@dataclass
class RefitReport:
    """What one refit moved and where its time went."""

    version_id: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    produce_s: float = 0.0
    send_s: float = 0.0
    wall_s: float = 0.0
    digest: str = ""


def refit_buckets(named: Iterable[tuple[str, torch.Tensor]], spec: NumericsSpec | str | None, *,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, all_linear: bool = False,
                  device: torch.device | str | None = None) -> Iterator[tuple[Bucket, bool]]:
    """The buckets of a refit, each with whether it is the last: ``named`` quantized under
    ``spec`` (None: unchanged). A row-scaled ``spec`` that stores decode scales (``minite``)
    is quantized straight into the buckets (:mod:`alignd.sync.fill`); any other is quantized
    then packed (:mod:`alignd.sync.stream`, :mod:`alignd.sync.buckets`): the same bits."""
    if spec is not None and fills(resolve_spec(spec)):
        return filled_buckets(named, spec, bucket_bytes=bucket_bytes, all_linear=all_linear,
                              device=device)
    stream = named if spec is None else quantize_named(named, spec, all_linear=all_linear,
                                                       bucket_bytes=bucket_bytes)
    return ended_buckets(stream, bucket_bytes, device)


class _Sender:
    """One worker thread sending buckets in order; the first error stops it.

    :meth:`put` returns once the worker took the bucket and the one before it was sent, so
    the caller builds the next bucket while exactly one is in flight.
    """

    def __init__(self, send: Send, report: RefitReport):
        self.send, self.report = send, report
        self.q: queue.Queue = queue.Queue(maxsize=1)
        self.idle = threading.Semaphore(1)  # released when a send ends
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="refit-send", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            bucket, header = item
            del item
            t0 = time.perf_counter()
            try:
                if self.error is None:  # nothing more is sent after a failure
                    self.send(bucket, header)
            except BaseException as e:  # raised in the caller's thread by put()/close()
                self.error = e
            finally:
                del bucket  # freed before the caller may build another
                self.report.send_s += time.perf_counter() - t0
                self.idle.release()

    def put(self, bucket: Bucket, header: RefitHeader) -> None:
        self.idle.acquire()
        self._raise()
        self.q.put((bucket, header))

    def close(self) -> None:
        self.idle.acquire()
        self.q.put(None)
        self.thread.join()
        self._raise()

    def stop(self) -> None:
        """End the worker after a failure on the caller's side (its send, if any, finishes)."""
        self.q.put(None)
        self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            self.idle.release()
            raise self.error


def run_refit(named: Iterable[tuple[str, torch.Tensor]], send: Send, *, version_id: str,
              spec: NumericsSpec | str | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              all_linear: bool = False, model: str | None = None,
              quantization: str | None = None, device: torch.device | str | None = None,
              header_entries: bool = True, stages: RefitStages | None = None) -> RefitReport:
    """Send version ``version_id`` of ``named`` through ``send``, bucket by bucket (see the
    module doc). ``quantization`` and ``model`` go into every header for the receiver to check;
    ``header_entries`` puts each bucket's entries in its header (a libalign receiver rebuilds
    the bucket from them); ``stages`` announces the version to the daemon (module doc).
    Returns the report once the last bucket was sent."""
    if not version_id or not isinstance(version_id, str):
        raise InputError(f"version_id must be a non-empty str, got {version_id!r}")
    report = RefitReport(version_id)
    if stages is not None:
        stages.begin()
    try:
        _run(named, send, report, spec, bucket_bytes, all_linear, model, quantization, device,
             header_entries, stages)
    except BaseException as e:
        if stages is not None:
            stages.failed(f"{type(e).__name__}: {e}"[:500])
        raise
    if stages is not None:
        stages.serving()
    return report


def _run(named, send, report, spec, bucket_bytes, all_linear, model, quantization, device,
         header_entries, stages) -> None:
    version_id = report.version_id
    spec_name = None if spec is None else (spec if isinstance(spec, str) else spec.name)
    digest = Digest()
    sender = _Sender(send, report)
    t_wall = time.perf_counter()
    try:
        produced = refit_buckets(named, spec, bucket_bytes=bucket_bytes, all_linear=all_linear,
                                 device=device)
        while True:
            t0 = time.perf_counter()
            item = next(produced, None)
            if item is not None and item[0].flat.device.type == "cuda":  # bytes there first
                torch.cuda.current_stream(item[0].flat.device).synchronize()
            report.produce_s += time.perf_counter() - t0
            if item is None:
                break
            b, last = item
            del item
            digest.add(b.entries)
            header = RefitHeader(version_id, report.buckets, model=model,
                                 quantization=quantization, spec=spec_name,
                                 entries=[e.to_dict() for e in b.entries] if header_entries else [])
            report.buckets += 1
            report.tensors += len(b.entries)
            report.bytes += b.nbytes
            if last:
                header = replace(header, last=True, tensors=digest.count,
                                 digest=digest.hexdigest())
                if stages is not None:
                    stages.produced()
            sender.put(b, header)
            del b  # the worker holds the bucket in flight; this thread builds the next
        if report.buckets == 0:
            raise InputError(f"refit of {version_id!r}: no tensors to send")
    except BaseException:
        sender.stop()
        raise
    sender.close()
    report.wall_s = time.perf_counter() - t_wall
    report.digest = digest.hexdigest()


@contextlib.contextmanager
def weight_update_session(sink: object) -> Iterator[None]:
    """SGLang's weight-update session around a refit, where the sink has one
    (``begin_weight_update`` / ``end_weight_update``: SGLang loads tensors only inside a session
    and prepares the loaded layers, ``process_weights_after_loading``, when it ends). The
    session is ended also after a failure, the refit's error then being the one raised."""
    begin = getattr(sink, "begin_weight_update", None)
    end = getattr(sink, "end_weight_update", None)
    if begin is None or end is None:
        yield
        return
    check_ok(begin(), "begin_weight_update")
    try:
        yield
    except BaseException:
        try:
            end()
        except Exception as e:  # the refit's own error is the one the caller needs
            log.warning("end_weight_update after a failed refit failed too: %s", e)
        raise
    check_ok(end(), "end_weight_update")


def check_ok(answer: object, what: str) -> None:
    """An SGLang-style ``(success, message)`` answer (tuple or dict) that failed, as an error."""
    ok, msg = True, ""
    if isinstance(answer, tuple) and len(answer) >= 2:
        ok, msg = bool(answer[0]), str(answer[1])
    elif isinstance(answer, dict) and "success" in answer:
        ok, msg = bool(answer["success"]), str(answer.get("message", ""))
    if not ok:
        raise WeightUpdateError(f"{what}: {msg}")

