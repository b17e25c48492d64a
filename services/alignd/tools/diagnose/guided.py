"""The TRACE conditions of a diagnosis: a guided learner against the sampler that recorded.

A condition whose learner is :data:`GUIDED` (``nvfp4_trace``) needs its sampler's guidance
records: the sampler's replay (and, on-policy, its generation) runs under
:func:`libalign.models.capture_guidance`; the records are encoded at ``bits`` bits a value for
the selected layers, decoded again (so the run exercises the real codec and reports real
sizes), and the learner scores under :func:`libalign.models.use_guidance`. The sampler must
quantize its activations with row scales (``nvfp4_minite``): records carry per-row scales.

The report's ``guidance`` section gives, per sampler: bytes per token (raw and zlib), and per
layer and site the share of the learner's codes that differ from the sampler's before guidance
(the row-scaled learner rounding to nearest on its own scales) and after.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from alignclient.errors import SpecError
from torch import nn

from alignd.tools.diagnose import sides
from alignd.tools.diagnose.conditions import GUIDED, Condition
from libalign import models
from libalign.gemm import PATHS
from libalign.guidance import GuidanceCapture, GuidanceRecord, GuidanceTable, select_layers
from libalign.models.teacher_forcing import replay_decode


def guided_conditions(conds: Sequence[Condition]) -> list[Condition]:
    """The conditions whose learner consumes guidance records."""
    return [c for c in conds if c.learner == GUIDED]


def check_guided(conds: Sequence[Condition]) -> None:
    """SpecError unless every guided condition's sampler quantizes activations per row."""
    for c in guided_conditions(conds):
        spec = PATHS[c.sampler].act_spec if c.sampler in PATHS else None
        if spec is None or spec.outer_domain != "row":
            raise SpecError(f"condition {c.name}: {GUIDED} needs a sampler that records row-scaled "
                            f"NVFP4 activations (e.g. nvfp4_minite), not {c.sampler!r}")


def recording_layers(model: nn.Module, last: int | None) -> list[int]:
    """The MoE layers the sampler records (all, or the last ``last``)."""
    return select_layers(models.moe_layer_indices(model), last)


def capture_spec(sampler: str):
    """The activation spec the sampler path quantizes with."""
    return PATHS[sampler].act_spec


class Guidance:
    """What one sampler recorded on one set of sequences, encoded, decoded and indexed."""

    def __init__(self, cap: GuidanceCapture, bits: int, layers: list[int], device: torch.device):
        full = cap.records(4, layers)
        # token positions the sampler ran (prompt and completion), counted at one layer's fc1
        tokens = sum(r.sites[(layers[0], "fc1")].rows for r in full.values()
                     if (layers[0], "fc1") in r.sites) if layers else 0
        recs = full if bits == 4 else cap.records(bits, layers)
        both = {sid: r.encode_many(("none", "zlib")) for sid, r in recs.items()}
        raw = {sid: b["none"] for sid, b in both.items()}
        self.bytes_raw = sum(len(b) for b in raw.values())
        self.bytes_zlib = sum(len(b["zlib"]) for b in both.values())
        self.bytes_full = sum(len(r.encode()) for r in full.values()) if bits != 4 else \
            self.bytes_raw
        self.tokens = tokens
        self.records = len(raw)
        self.table = GuidanceTable({sid: GuidanceRecord.decode(b, device) for sid, b in raw.items()},
                                   device)
        self.reference = GuidanceTable(full, device)

    def summary(self) -> dict:
        """Sizes per token for the report."""
        per = (lambda b: b / self.tokens) if self.tokens else (lambda b: None)
        return {"records": self.records, "token_positions": self.tokens,
                "bytes_per_token": per(self.bytes_raw),
                "bytes_per_token_zlib": per(self.bytes_zlib),
                "bytes_per_token_full_codes": per(self.bytes_full)}


def replay_with_capture(model, tokens, prompt_lens, sampler: str, layers: list[int], *,
                        progress=None, **common) -> tuple[list[torch.Tensor], GuidanceCapture]:
    """The sampler's teacher-forced decode while its activations are recorded."""
    with models.capture_guidance(model, layers, capture_spec(sampler)) as cap:
        lp = replay_decode(model, tokens, prompt_lens, sampler, progress=progress, **common)
    return lp, cap


def score_guided(model, tokens, prompt_lens, guidance: Guidance, *, progress=None,
                 **common) -> tuple[list[torch.Tensor], list[dict]]:
    """The guided learner's scores, and per layer/site code agreement before and after guidance."""
    before, after = models.CodeAgreement(), models.CodeAgreement()
    with models.use_guidance(model, None, reference=guidance.reference, agreement=before):
        sides.score(model, tokens, prompt_lens, GUIDED, **common)
    with models.use_guidance(model, guidance.table, reference=guidance.reference, agreement=after):
        lp = sides.score(model, tokens, prompt_lens, GUIDED, progress=progress, **common)
    rows = []
    for b, a in zip(before.table(), after.table(), strict=True):
        rows.append({"layer": b["layer"], "site": b["site"], "values": b["values"],
                     "mismatch_before": b["mismatch"], "mismatch_after": a["mismatch"],
                     "rows_with_record": a["rows_with_record"]})
    return lp, rows
