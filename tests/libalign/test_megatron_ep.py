"""Expert parallelism across processes: a Megatron GPT MoE over two ``gloo`` ranks on the CPU
computes what one process computes, exports the same checkpoint, and publishes a sharded NVFP4
version bit-identical to converting the gathered weights."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from alignclient.errors import ConfigError, DistributedRunError
from alignd.formats.selection import make_select
from alignd.formats.weight_store import WeightStore

from libalign.models import build_model
from libalign.models.megatron_parallel import NO_MULTICAST_ENV, check_layout, launch
from libalign.spec import PRESETS
from tests import background
from tests.libalign import ep_workers as W

# These run Megatron on the CPU through libalign's CPU shims. On a host with CUDA the shimmed
# ``torch.cuda.current_device`` meets megatron-core's compiled router (torch.compile indexes
# devices by it) and fails; the ``gpu`` tests cover that host instead.
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="CPU-shim test; the gpu-marked tests cover CUDA hosts")

SPECS = {"row": "minite", "tensor": "te"}
PATHS = ("bf16", "nvfp4_minite")
TRAIN_PATH = "nvfp4_minite"


def _assert_same_version(got, ref) -> None:
    """Same tensor names; raw tensors equal; NVFP4 tensors of the same spec, bit for bit."""
    assert set(got.tensors) == set(ref.tensors)
    for name, want in ref.tensors.items():
        have = got.tensors[name]
        if isinstance(want, torch.Tensor):
            assert torch.equal(have, want), name
        else:
            assert have.spec == want.spec and have.bitwise_equal(want), name


@pytest.fixture(scope="module")
def hf_sd():
    model = build_model(W.config(), seed=1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for _r in range(2):
        ids = torch.randint(0, W.config().vocab_size, (2, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0
        out.append((ids, mask))
    return out


@pytest.fixture(scope="module")
def ep_runs(hf_sd, tmp_path_factory):
    """One process with every expert, and two expert-parallel ranks, on the same weights, each
    launched once: the forward/backward of both paths (the ranks publishing sharded versions
    into a store per path), then one training step on nvfp4_minite."""
    batches = _batches()
    stores = {p: tmp_path_factory.mktemp(f"store-{p}") for p in PATHS}
    publish = {p: [(str(root), f"v-{kind}", spec) for kind, spec in SPECS.items()]
               for p, root in stores.items()}
    one = launch(W.forward_backward_then_train, 1,
                 args=(hf_sd, batches, [(p, ()) for p in PATHS], TRAIN_PATH), backend="gloo")[0]
    two = launch(W.forward_backward_then_train, 2,
                 args=(hf_sd, batches, [(p, publish[p]) for p in PATHS], TRAIN_PATH),
                 expert_model_parallel_size=2, backend="gloo")
    return batches, stores, one, two


@pytest.fixture(scope="module", params=PATHS)
def runs(request, ep_runs):
    """``(path, batches, one process, two ranks, the ranks' store)`` of a forward/backward."""
    path = request.param
    batches, stores, one, two = ep_runs
    return (path, batches, one["forward_backward"][path],
            [r["forward_backward"][path] for r in two], WeightStore(stores[path]))


@CPU_ONLY
def test_each_rank_holds_its_half_of_the_experts(runs):
    _path, _b, _one, two, _store = runs
    assert [r["ep_rank"] for r in two] == [0, 1] and all(r["ep_size"] == 2 for r in two)
    for r in two:
        start = 4 * r["ep_rank"]
        assert set(r["ranges"].values()) == {(start, 8)}
        assert r["env"] == NO_MULTICAST_ENV


@CPU_ONLY
def test_logits_equal_one_process_bitwise(runs):
    """Each rank's logits for its own batch are the one-process model's logits of that batch."""
    _path, batches, one, two, _store = runs
    for r, (_ids, mask) in enumerate(batches):
        real = mask.bool()
        assert torch.equal(two[r]["logits"][real], one["logits"][2 * r:2 * r + 2][real])


@CPU_ONLY
def test_expert_gradients_gather_every_ranks_tokens(runs):
    """A rank's expert gradients hold both ranks' tokens: they equal the one-process gradient
    of the summed loss (to fp32 summation order)."""
    _path, _b, one, two, _store = runs
    for r in two:
        for i, (start, g1, g2) in r["expert_grads"].items():
            _s, ref1, ref2 = one["expert_grads"][i]
            for got, ref in ((g1, ref1[start:start + 4]), (g2, ref2[start:start + 4])):
                ref = ref.float()
                assert ref.norm() > 0
                assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-6


@CPU_ONLY
def test_exports_are_the_checkpoint(runs, hf_sd):
    """Fused export (all-gathered) is the checkpoint bit for bit; the local export is the slice."""
    _path, _b, _one, two, _store = runs
    for r in two:
        assert set(r["fused"]) == set(hf_sd)
        assert all(torch.equal(r["fused"][k], hf_sd[k]) for k in hf_sd)
        for name, (start, total) in r["ranges"].items():
            assert total == hf_sd[name].shape[0]
            assert torch.equal(r["local"][name], hf_sd[name][start:start + 4])


@CPU_ONLY
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_sharded_publish_equals_gathered_conversion(runs, hf_sd, kind, tmp_path):
    """Two ranks each quantize their own experts; the committed version reads back bit for bit
    as converting the gathered checkpoint in one process (row domain: independent rows;
    tensor domain: the all-reduced maximum)."""
    _path, _b, _one, two, store = runs
    vid = f"v-{kind}"
    assert any(r["published"][vid] for r in two)  # the last part to land committed it
    assert vid in store.list_versions()
    got = store.read_version(vid)
    ref_store = WeightStore(tmp_path)
    ref_store.write_version("ref", hf_sd, PRESETS[SPECS[kind]], select=make_select())
    _assert_same_version(got, ref_store.read_version("ref"))


@CPU_ONLY
def test_a_failing_rank_is_reported_by_name():
    with pytest.raises(DistributedRunError, match="rank 1: ValueError: rank one says no"):
        launch(W.fail_on_rank_one, 2, backend="gloo", timeout_s=120)


def test_impossible_layouts_are_refused_before_starting():
    with pytest.raises(ConfigError, match="must divide"):
        check_layout(3, 2, "gloo")
    with pytest.raises(ConfigError, match="backend"):
        check_layout(2, 2, "mpi")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ConfigError, match="one GPU per rank"):
            check_layout(64, 2, "nccl")


@pytest.fixture(scope="module")
def train_runs(ep_runs):
    """``(one process, two ranks)`` of one training step on TRAIN_PATH."""
    _batches, _stores, one, two = ep_runs
    return one["train"], [r["train"] for r in two]


@CPU_ONLY
def test_a_train_step_on_two_ranks_is_the_one_process_step(train_runs, hf_sd):
    """Each rank trains on half of the batch; the step is the whole batch's: the same loss,
    token count and clipping norm, replicated weights still equal across ranks, and the
    updated weights those of one process on the whole batch (Adam's first step moves each
    weight by lr * sign(g), so only gradients within rounding of zero may flip)."""
    one, two = train_runs
    for r in two:
        s, ref = r["stats"], one["stats"]
        assert s["tokens"] == ref["tokens"]
        assert s["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert s["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert s["ratio_mean"] == pytest.approx(ref["ratio_mean"], rel=1e-6)
        assert s["reward_mean"] == ref["reward_mean"]
    assert all(torch.equal(two[0]["weights"][k], two[1]["weights"][k]) for k in hf_sd)
    for k in hf_sd:
        got, want = two[0]["weights"][k], one["weights"][k]
        assert (got != want).float().mean().item() <= 0.01, k
        assert (got.float() - want.float()).abs().max().item() <= 2.5e-3, k
        if ".experts." in k:  # the experts' gradients hold every rank's tokens, summed once
            assert torch.equal(got, want), k


@CPU_ONLY
def test_ranks_with_different_micro_batch_counts_are_refused():
    """Every forward is collective: 3 micro-batches on one rank and 1 on the other would hang,
    so both ranks refuse the step by name."""
    hf = build_model(W.config(), seed=1)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    with pytest.raises(DistributedRunError, match="micro-batches"):
        launch(W.train_one_step, 2, args=(sd, "bf16", [6, 2], 2), backend="gloo", timeout_s=120)


def test_torchrun_environment_is_read(monkeypatch):
    """Under torchrun the rank, world and rendezvous come from the environment."""
    from libalign.models.megatron_parallel import process_group

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="RANK"), process_group():
        pass
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="integer"), process_group():
        pass


def _torchrun_probe(_folder):
    from libalign.models.megatron_parallel import free_port

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", free_port,
             str(root / "tests" / "libalign" / "torchrun_probe.py")], env)


background.register("torchrun_probe", background.Job(
    ("test_megatron_ep.py::test_ranks_started_by_torchrun",), lambda: None, _torchrun_probe,
    timeout_s=180, in_folder=True))


def test_ranks_started_by_torchrun_join_from_the_environment():
    """Two ranks started by ``torchrun`` (a background job, tests/background.py) read rank,
    world and rendezvous from the environment and join one expert-parallel group."""
    out = background.result("torchrun_probe")
    # the two ranks share one stdout pipe: their lines may interleave without a newline
    lines = sorted(re.findall(r"probe rank=\d+ world=\d+ ep=\d+/\d+ sum=\S+ env=(?:True|False)",
                              out.stdout))
    assert out.returncode == 0, out.tail(2000)
    assert lines == [f"probe rank={r} world=2 ep={r}/2 sum=3 env=True" for r in (0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_two_ranks_sharing_one_gpu_compute_the_one_process_logits(hf_sd, path, tmp_path):
    """The same on a GPU (two ranks share it through ``gloo``; libalign's GPU GEMM backends):
    logits bit for bit, expert gradients to summation order, and the sharded version converted
    by the CUDA kernel bit-identical to converting the gathered checkpoint."""
    batches = _batches()
    publish = [(str(tmp_path), "v", "minite")]
    one = launch(W.forward_backward, 1, args=(hf_sd, batches, path), backend="gloo",
                 device="cuda")[0]
    two = launch(W.forward_backward, 2, args=(hf_sd, batches, path, publish), backend="gloo",
                 device="cuda")
    for r, (_ids, mask) in enumerate(batches):
        real = mask.bool()
        assert torch.equal(two[r]["logits"][real], one["logits"][2 * r:2 * r + 2][real])
        for i, (start, g1, _g2) in two[r]["expert_grads"].items():
            ref = one["expert_grads"][i][1][start:start + 4].float()
            assert ((g1.float() - ref).norm() / ref.norm()).item() < 1e-2
    store = WeightStore(tmp_path)
    got = store.read_version("v")
    ref_store = WeightStore(tmp_path / "ref")
    ref_store.write_version("ref", hf_sd, PRESETS["minite"], select=make_select())
    _assert_same_version(got, ref_store.read_version("ref"))


@CPU_ONLY
def test_four_ranks_two_expert_parallel_groups_train_and_publish(train_runs, hf_sd, tmp_path):
    """World 4, expert parallelism 2: two replicas of each expert half (expert data
    parallelism 2). The step still equals one process's on the whole batch (expert gradients
    summed over the replicas, dense ones over all four ranks), and the sharded version has two
    parts, written by the first replica of each half only, bit-identical to converting the
    gathered weights."""
    one, _two = train_runs
    four = launch(W.train_one_step, 4, args=(hf_sd, "nvfp4_minite", None, 8, (str(tmp_path), "v")),
                  expert_model_parallel_size=2, backend="gloo", timeout_s=300)
    assert [r["place"] for r in four] == [(0, 2, True), (1, 2, True), (0, 2, False), (1, 2, False)]
    assert [r["published"] is None for r in four] == [False, False, True, True]
    for r in four:
        s, ref = r["stats"], one["stats"]
        assert s["tokens"] == ref["tokens"]
        assert s["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert s["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    for k in hf_sd:
        assert all(torch.equal(r["weights"][k], four[0]["weights"][k]) for r in four[1:]), k
        got, want = four[0]["weights"][k], one["weights"][k]
        assert (got != want).float().mean().item() <= 0.01, k
        assert (got.float() - want.float()).abs().max().item() <= 2.5e-3, k
    store = WeightStore(tmp_path)
    assert store.read_manifest("v").num_parts == 2
    ref_store = WeightStore(tmp_path / "ref")
    ref_store.write_version("ref", four[0]["weights"], PRESETS["minite"], select=make_select())
    _assert_same_version(store.read_version("v"), ref_store.read_version("ref"))
