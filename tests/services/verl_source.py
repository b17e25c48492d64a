"""verl's own functions, run with torch alone, from the files ./dev.sh installs beside the venv.

``./dev.sh test`` installs verl (tests/services/verl_cpu.txt) with ``pip install --no-deps
--target $VENV/verl-cpu``. Importing the ``verl`` package would pull Ray, tensordict and
omegaconf (``verl/__init__.py`` imports ``verl.protocol``), none of which the functions compared
here use. So nothing is imported from there: :func:`load` parses one installed file, drops its
``verl`` imports (module level and inside functions), and executes the rest, or only the named
top-level functions, in a namespace that supplies those names: ``verl_F`` holds verl's own
``masked_sum``/``masked_mean`` read the same way from ``verl/utils/torch_functional.py``, and
``DataProto`` is a stand-in that keeps the one tensor dict the rollout correction wraps. The
functions' bodies run exactly as verl ships them.
"""

from __future__ import annotations

import ast
import math
import os
import sys
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, Optional

import torch

VERL_DIR = Path(os.environ.get("ALIGN_VERL_CPU", Path(sys.prefix) / "verl-cpu"))


def available() -> bool:
    return (VERL_DIR / "verl" / "trainer" / "ppo" / "rollout_corr_helper.py").is_file()


class _StripVerlImports(ast.NodeTransformer):
    def visit_Import(self, node):
        return None if any(a.name.split(".")[0] == "verl" for a in node.names) else node

    def visit_ImportFrom(self, node):
        return None if (node.module or "").split(".")[0] in ("verl", "omegaconf") else node


class DataProto:
    """Stand-in for ``verl.protocol.DataProto``: the tensor dict under ``.batch``."""

    def __init__(self, batch: dict):
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors: dict):
        return cls(dict(tensors))


def _exec(path: Path, names: tuple[str, ...] | None, ns: dict) -> dict:
    tree = _StripVerlImports().visit(ast.parse(path.read_text(), str(path)))
    if names is not None:
        tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    for n in tree.body:  # verl's registry decorators are not defined here
        if isinstance(n, ast.FunctionDef):
            n.decorator_list = []
    ast.fix_missing_locations(tree)
    exec(compile(tree, str(path), "exec"), ns)
    return ns


@cache
def verl_functional() -> types.SimpleNamespace:
    """``masked_sum``, ``masked_mean`` and ``distributed_masked_mean`` of verl."""
    ns = _exec(VERL_DIR / "verl/utils/torch_functional.py",
               ("masked_sum", "masked_mean", "distributed_masked_mean"), {"torch": torch})
    return types.SimpleNamespace(**{k: ns[k] for k in ("masked_sum", "masked_mean",
                                                        "distributed_masked_mean")})


@cache
def rollout_corr() -> dict[str, Any]:
    """The namespace of ``verl/trainer/ppo/rollout_corr_helper.py``."""
    ns = {"__name__": "verl_rollout_corr_helper", "math": math, "torch": torch, "Any": Any,
          "Optional": Optional, "verl_F": verl_functional(), "DataProto": DataProto,
          "RolloutCorrectionConfig": dict, "PolicyLossConfig": dict}
    return _exec(VERL_DIR / "verl/trainer/ppo/rollout_corr_helper.py", None, ns)


@cache
def policy_losses() -> dict[str, Callable]:
    """verl's ``agg_loss``, ``compute_policy_loss_vanilla``, ``compute_policy_loss_reinforce``
    and ``compute_policy_loss_bypass_mode`` (``verl/trainer/ppo/core_algos.py``)."""
    ns = {"torch": torch, "Any": Any, "Optional": Optional, "verl_F": verl_functional(),
          "AlgoConfig": type("AlgoConfig", (), {}), "ActorConfig": object, "DictConfig": dict,
          "compute_rollout_correction_and_rejection_mask":
              rollout_corr()["compute_rollout_correction_and_rejection_mask"]}
    return _exec(VERL_DIR / "verl/trainer/ppo/core_algos.py",
                 ("agg_loss", "compute_policy_loss_vanilla", "compute_policy_loss_reinforce",
                  "compute_policy_loss_bypass_mode"), ns)


@cache
def debug_metrics() -> Callable:
    """verl's ``calculate_debug_metrics`` (``verl/utils/debug/metrics.py``)."""
    import logging

    ns = {"torch": torch, "logging": logging, "logger": logging.getLogger("verl_debug"),
          "DataProto": DataProto}
    path = VERL_DIR / "verl/utils/debug/metrics.py"
    names = ("calculate_token_list_diff", "pearson_correlation_coefficient",
             "calculate_log_prob_diff", "calculate_debug_metrics")
    return _exec(path, names, ns)["calculate_debug_metrics"]
