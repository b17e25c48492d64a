"""``alignd diagnose``: measure and localize the learner–sampler execution gap of an MoE model.

* :mod:`.run` — the orchestration and what is measured on which tokens (read it first);
* :mod:`.conditions` — ``learner/sampler`` path pairs and the cross-path floor;
* :mod:`.inputs` — prompt and sequence files, validated with errors that name the item;
* :mod:`.sides` — sampling, the teacher-forced KV-cached sampler replay, learner scoring;
* :mod:`.stats` — δ summaries, cluster-bootstrap CIs, paired comparisons to the floor;
* :mod:`.localize` — per-layer FC1/FC2 and routing, the decoder-layer 2×2 replay, the
  context-swap check;
* :mod:`.replay` — the 2×2 replay at the MoE entry (I_j, E_j, R(h_L, h_R) per prompt);
* :mod:`.routing` — routing disagreement and δ without and with routing replay (R3);
* :mod:`.kv` — the FP4 KV cache's share of δ, paired against BF16 K/V, KV guidance off and on;
* :mod:`.plots` / :mod:`.render` — PNG figures, rich tables and JSON.
"""

from alignd.tools.diagnose.run import DiagnoseConfig, Reporter, run_diagnosis, write_outputs

__all__ = ["DiagnoseConfig", "Reporter", "run_diagnosis", "write_outputs"]
