"""The KV cache's share of the gap: δ with the sampler's FP4 K/V against the same run with BF16 K/V.

A sampler with an FP4 KV cache (TRACE's FP4 rollout; SGLang's ``--kv-cache-dtype nvfp4`` or
``fp4_mx_block16``) attends over K and V rounded once, when each token was written. How much
of the learner–sampler gap that rounding adds, and how much of it KV guidance takes back, is a
comparison on the **same tokens**, so it is measured on the diagnosis' shared sequences with
the aligned pair ``nvfp4_minite/nvfp4_minite`` (the FP4 KV paths are that pair with a KV
format) and framed against that pair with K and V in the model's dtype:

1. **BF16 K/V** (the baseline): both sides keep K and V in bf16; δ is the pair's own.
2. **FP4 K/V, learner BF16 K/V**: the sampler replays its decode through an FP4 cache
   (:func:`libalign.models.use_kv_format`), the learner scores as before: what a learner that
   does not reproduce the sampler's KV cache sees.
3. **FP4 K/V, guidance off**: the learner quantizes K and V in the same format, each row
   rounded to nearest on its own values (``nvfp4_minite_kv_*`` on both sides).
4. **FP4 K/V, guidance on**: the learner rounds each K/V row as the sampler's record of it
   says (:func:`libalign.models.use_kv_guidance`, records of ``bits`` bits a value made by
   :func:`libalign.models.capture_kv` during the sampler's replay; activations unguided, so
   only the KV guidance differs from row 3).

Rows 2–4 carry the paired cluster bootstrap of ``stat(row) − stat(BF16 K/V)`` (P99 |δ| and
clip potential, one resample of whole sequences for both: :func:`.stats.compare`), and row 4
also ``stat(guidance on) − stat(guidance off)``. Rows 3 and 4 count the share of the
learner's K/V codes that differ from the sampler's (:func:`libalign.models.count_kv_agreement`
against the sampler's full codes). A format with a per-layer global scale
(``kv_sglang_nvfp4``) runs with SGLang's default 1.0 for every layer on both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from alignclient.errors import SpecError
from torch import nn

from alignd.tools.diagnose import sides, stats
from alignd.tools.diagnose.conditions import split_list
from libalign import models
from libalign.guidance import GuidanceCapture, GuidanceRecord, GuidanceTable
from libalign.models.kv_cache import kv_scales_for, kv_spec_of
from libalign.models.kv_guided import KVAgreement
from libalign.models.teacher_forcing import replay_decode
from libalign.spec import PRESETS
from libalign.spec.presets import KV_PRESETS

#: The pair whose KV cache is measured: the FP4 KV paths are this pair with a KV format.
PAIR = "nvfp4_minite"
LEARNER_BF16, GUIDE_OFF, GUIDE_ON = ("FP4 K/V, learner bf16 K/V", "FP4 K/V, guidance off",
                                     "FP4 K/V, guidance on")


def parse_formats(text: str | None) -> list[str]:
    """KV presets of ``--kv-formats`` (comma list; ``all``: every one); SpecError naming an
    unknown one."""
    if text is not None and text.strip().lower() == "all":
        return list(KV_PRESETS)
    out = []
    for name in split_list(text):
        if name not in KV_PRESETS:
            raise SpecError(f"--kv-formats: unknown KV format {name!r}; known: "
                            f"{', '.join(KV_PRESETS)}")
        out.append(name)
    return list(dict.fromkeys(out))


def _mismatch(agreement: KVAgreement) -> float | None:
    values = agreement.total(agreement.values)
    return agreement.total(agreement.mismatched) / values if values else None


def _record_bytes(records: dict[int, GuidanceRecord], tokens: Sequence[Sequence[int]]) -> float:
    """Encoded K/V record bytes per token position the sampler wrote."""
    return sum(len(r.encode()) for r in records.values()) / max(sum(map(len, tokens)), 1)


def kv_share(model: nn.Module, tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int],
             formats: Sequence[str], opts: stats.StatOptions, *, bits: int,
             sampler_lp: list[torch.Tensor] | None = None,
             learner_lp: list[torch.Tensor] | None = None,
             task: Callable[[str, int], Callable[[int], None]] | None = None,
             **common) -> dict:
    """The report's ``kv`` section (module doc) for each of ``formats`` on the shared tokens.

    ``sampler_lp``/``learner_lp`` are the pair's log-probs with BF16 K/V when the diagnosis
    has them already (computed here otherwise); ``task(description, total)`` gives a progress
    callable; ``common`` are the batch settings of :func:`.sides.score`.
    """
    n = len(tokens)
    prog = (lambda what: task(what, n)) if task is not None else (lambda what: None)
    if sampler_lp is None:
        sampler_lp = replay_decode(model, tokens, prompt_lens, PAIR, progress=prog(
            "kv: replay bf16 K/V"), **common)
    if learner_lp is None:
        learner_lp = sides.score(model, tokens, prompt_lens, PAIR, progress=prog(
            "kv: score bf16 K/V"), **common)
    base = stats.deltas(learner_lp, sampler_lp)
    layers = models.model_geometry(model)["layers"]
    out: dict = {"pair": f"{PAIR}/{PAIR}", "bits": bits, "bf16_kv": stats.summarize(base, opts),
                 "formats": {}}
    for name in formats:
        spec = kv_spec_of(name)
        scales = kv_scales_for(spec, None, layers)
        cap = GuidanceCapture(PRESETS["minite"])
        with models.use_kv_format(model, spec, scales), models.capture_kv(model, cap):
            fp4_sampler = replay_decode(model, tokens, prompt_lens, PAIR,
                                        progress=prog(f"kv: replay {name}"), **common)
        reference = GuidanceTable(cap.records(4), next(model.parameters()).device)
        records = cap.records(bits)
        agree = {GUIDE_OFF: KVAgreement(), GUIDE_ON: KVAgreement()}
        learner = {LEARNER_BF16: learner_lp}
        for row, recs in ((GUIDE_OFF, None), (GUIDE_ON, records)):
            with models.use_kv_format(model, spec, scales), \
                    models.use_kv_guidance(model, recs, bits=bits if recs else None), \
                    models.count_kv_agreement(model, reference, agree[row]):
                learner[row] = sides.score(model, tokens, prompt_lens, PAIR,
                                           progress=prog(f"kv: score {name}, {row}"), **common)
        delta = {row: stats.deltas(lp, fp4_sampler) for row, lp in learner.items()}
        rows = []
        for row, d in delta.items():
            r = {"name": row, "shared": stats.summarize(d, opts),
                 "vs_bf16_kv": stats.compare(d, base, opts),
                 "kv_code_mismatch": _mismatch(agree[row]) if row in agree else None}
            if row == GUIDE_ON:
                r["vs_guidance_off"] = stats.compare(d, delta[GUIDE_OFF], opts)
            rows.append(r)
        out["formats"][name] = {
            "scales": None if scales is None else scales.source,
            "sampler_shift_p99_abs": float(torch.cat(
                [(a.double() - b.double()).abs() for a, b in zip(fp4_sampler, sampler_lp,
                                                                   strict=True)]).quantile(0.99)),
            "record_bytes_per_token": _record_bytes(records, tokens),
            "rows": rows}
    return out
