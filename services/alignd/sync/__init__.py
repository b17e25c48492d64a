"""Weight sync: how a version gets from the learner to the samplers, one module per transport.

The walk, end to end:

1. **The learner publishes.** Either BF16 for the converter (:mod:`~alignd.sync.bf16`: the
   weights written as a published directory, then registered and announced on the
   ``published`` stream), or already converted: the learner quantizes itself, in one process
   (:mod:`libalign.sync` into store buffers) or on every expert-parallel rank, each writing its
   part of a sharded version (:mod:`~alignd.sync.sharded`).
2. **The converter converts** a published version (:mod:`alignd.converter.worker`) into an
   NVFP4 store version, verified by checksum, written atomically.
3. **The version is announced** (:mod:`~alignd.sync.announce`, the one place that builds the
   registry record and the events): ``published`` for the converter, ``converted`` for the
   samplers, with the same registry states whichever side converted.
4. **Samplers load it** (:mod:`alignd.sampler.service`): the embedded engine from the store,
   an SGLang server from disk (:mod:`alignd.sampler.sglang_engine`), and switch only once the
   whole version has arrived and verified.

**Refit from tensors**, without a directory: a trainer's named tensors are quantized on the way
(:mod:`~alignd.sync.stream`), packed into flattened buckets (:mod:`~alignd.sync.buckets`), or
for ``minite`` quantized straight into them (:mod:`~alignd.sync.fill`), and
sent by the shared sender (:mod:`~alignd.sync.refit`) over SGLang's colocated
(:mod:`~alignd.sync.tensor`) or broadcast (:mod:`~alignd.sync.distributed`) protocol; a
receiver stages a version and applies it whole (:mod:`~alignd.sync.receive`). The version walks
the same registry states (:class:`~alignd.sync.announce.RefitStages`).

Trainers that use the daemon in-process reach the same functions through
:class:`alignd.integrations.WeightPublisher` or the API (``POST /v1/versions`` registers a
published directory with :func:`~alignd.sync.announce.announce_published`).
"""
