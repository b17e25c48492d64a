"""``trace_paper`` (``ALIGN_TRACE_PAPER``, ``--trace-paper``): the TRACE paper's defaults as a
settings profile that fills unset fields and never overrides an explicit one."""

from alignd.infra.settings import (
    TRACE_PAPER_DEFAULTS,
    AllInOneSettings,
    ApiSettings,
    LearnerSettings,
    SamplerSettings,
)

from libalign.guidance.records import select_layers
from libalign.guidance.sizes import size_for_config


def test_profile_fills_each_class_with_its_own_fields():
    """Learner: b=1, token TIS cap 5, max_version_diff 3, R3 recompute; sampler: the latter half
    of the layers; the API: max_version_diff 3; off, nothing changes."""
    learner = LearnerSettings(trace_paper=True)
    assert (learner.guidance_bits, learner.tis_cap, learner.tis_level, learner.max_version_diff,
            learner.routing_replay) == (1, 5.0, "token", 3, "recompute")
    assert SamplerSettings(trace_paper=True).guidance_last_layers == "half"
    assert ApiSettings(trace_paper=True).max_version_diff == 3
    plain = LearnerSettings()
    assert (plain.tis_cap, plain.max_version_diff, plain.routing_replay) == (2.0, None, "off")
    assert set(TRACE_PAPER_DEFAULTS) <= set(AllInOneSettings.model_fields)


def test_explicit_settings_win(monkeypatch):
    """A keyword or an ALIGN_* variable keeps its value under the profile."""
    monkeypatch.setenv("ALIGN_TRACE_PAPER", "true")
    monkeypatch.setenv("ALIGN_TIS_CAP", "3.5")
    s = AllInOneSettings(guidance_last_layers=2)
    assert (s.tis_cap, s.guidance_last_layers, s.max_version_diff) == (3.5, 2, 3)


def test_half_selects_the_latter_half_of_the_moe_layers():
    """``half`` records layers n//2.. (the larger half of an odd count), and sizes count them."""
    assert select_layers([0, 1, 2, 3]) == [0, 1, 2, 3]
    assert select_layers([3, 0, 2, 1], "half") == [2, 3]
    assert select_layers(range(5), "half") == [2, 3, 4]
    cfg = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
           "num_hidden_layers": 4, "num_experts": 8}
    half = size_for_config(cfg, bits=1, last_layers="half")["total"]
    assert half == size_for_config(cfg, bits=1, last_layers=2)["total"]
    assert half < size_for_config(cfg, bits=1)["total"]
