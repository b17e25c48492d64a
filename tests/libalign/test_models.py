"""libalign.models: path swapping on stock HF Qwen3-MoE, capture, routing control, scoring, cache."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

pytest.importorskip("transformers")

from alignclient.errors import ConfigError, InputError, ShapeError, SpecError

from libalign import gemm
from libalign.atomic_dir import writer_tag
from libalign.models import (
    SyntheticTask,
    build_model,
    capture,
    current_paths,
    experts_module,
    force_routing,
    generate,
    qwen3_30b_a3b_shaped_config,
    replay_layer,
    replay_moe,
    reset_paths,
    score_sequences,
    set_path,
    tiny_config,
    trained_tiny_model,
    use_path,
    write_dir_atomically,
)
from libalign.models import train as train_mod

TASK = SyntheticTask()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(num_hidden_layers=2), seed=3)


def _batch(n=3, seed=0):
    prompts = TASK.prompts(n, seed)
    seqs = [p + TASK.answer_ids(p) for p in prompts]
    width = max(map(len, seqs)) + 2
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s)
        mask[r, :len(s)] = 1
    return seqs, [len(p) for p in prompts], ids, mask


def _logits(m, ids, mask=None):
    with torch.no_grad():
        return m(input_ids=ids, attention_mask=mask).logits


# --- configs, task --------------------------------------------------------------------------

def test_configs_have_the_promised_shapes():
    """tiny_config and the 30B-A3B-shaped config carry the documented sizes (K multiple of 16)."""
    t = tiny_config()
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_experts, t.num_experts_per_tok,
            t.moe_intermediate_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (
        TASK.vocab_size, 128, 4, 8, 2, 64, 4, 2, 32)
    assert t.norm_topk_prob and not t.tie_word_embeddings
    assert tiny_config(num_hidden_layers=1).num_hidden_layers == 1
    q = qwen3_30b_a3b_shaped_config(num_layers=3)
    assert (q.hidden_size, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size,
            q.num_attention_heads, q.num_key_value_heads, q.head_dim, q.vocab_size,
            q.num_hidden_layers) == (2048, 128, 8, 768, 32, 4, 128, 151936, 3)
    assert q.rope_parameters["rope_theta"] == 1e6


def test_build_model_is_deterministic_by_seed():
    """Same seed, same weights; another seed, other weights; eval mode and the asked dtype."""
    cfg = tiny_config(num_hidden_layers=1)
    a, b, c = (build_model(cfg, seed=s) for s in (1, 1, 2))
    assert not a.training and a.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    std = float(experts_module(a, 0).gate_up_proj.detach().float().std())
    assert 0.015 < std < 0.025


def test_task_round_trip_and_verifier():
    """Prompts encode/decode, the verifier accepts exactly the reversed sum + eos, splits are disjoint."""
    assert TASK.max_digits == 4
    p = TASK.prompt_ids(347, 85)
    assert TASK.decode(p) == "<bos>0347+0085="
    assert TASK.encode(TASK.decode(p)) == p
    assert TASK.decode(TASK.answer_ids(p)) == "234<eos>"
    assert TASK.verify(p, TASK.encode("234<eos><pad>"))
    assert not TASK.verify(p, TASK.encode("234"))
    assert not TASK.verify(p, TASK.encode("235<eos>"))
    assert TASK.decode(TASK.answer_ids(TASK.prompt_ids(4, 3))) == "7<eos>"
    ev = {tuple(x) for x in TASK.prompts(200, 0)}
    assert all(TASK.in_eval_split(*TASK.parse_prompt(x)) for x in ev)
    assert TASK.prompts(5, 1) == TASK.prompts(5, 1)
    with pytest.raises(InputError):
        TASK.encode("12x")
    with pytest.raises(InputError):
        TASK.prompt_ids(10_000, 1)
    assert SyntheticTask(max_digits=2).decode(SyntheticTask(max_digits=2).prompt_ids(7, 12)) == "<bos>07+12="


# --- path swapping --------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_bf16_path_equals_stock_forward_bitwise(model, impl):
    """use_path(model, 'bf16') reproduces Hugging Face's expert forward exactly, and leaves it."""
    _, _, ids, mask = _batch()
    before = model.config._experts_implementation
    model.config._experts_implementation = impl
    try:
        want = _logits(model, ids, mask)
        with use_path(model, "bf16"):
            assert "forward" in experts_module(model, 0).__dict__
            got = _logits(model, ids, mask)
    finally:
        model.config._experts_implementation = before
    assert torch.equal(got, want)
    assert "forward" not in experts_module(model, 0).__dict__


def test_quantized_paths_change_logits_slightly(model):
    """NVFP4 paths move the logits, but by a small fraction of their spread."""
    _, _, ids, mask = _batch()
    ref = _logits(model, ids, mask).float()
    for name in ("nvfp4_naive", "nvfp4_minite"):
        with use_path(model, name):
            got = _logits(model, ids, mask).float()
        rel = float((got - ref).norm() / ref.norm())
        assert 1e-4 < rel < 0.1, (name, rel)
    # One layer at a time, through a dict (the other layer runs bf16).
    with use_path(model, {1: "nvfp4_minite"}):
        assert current_paths(model) == {0: "bf16", 1: "nvfp4_minite"}
        assert not torch.equal(_logits(model, ids, mask).float(), ref)


def test_path_restored_after_exception_and_nesting(model):
    """The previous forward comes back on exit, also when the block raises; blocks nest."""
    ex = experts_module(model, 0)
    with pytest.raises(RuntimeError, match="boom"), use_path(model, "nvfp4_naive"):
        raise RuntimeError("boom")
    assert current_paths(model) == {0: None, 1: None}
    assert "forward" not in ex.__dict__
    with use_path(model, "nvfp4_naive"):
        with use_path(model, "nvfp4_minite", layers=[1]):
            assert current_paths(model) == {0: "bf16", 1: "nvfp4_minite"}
        assert current_paths(model) == {0: "nvfp4_naive", 1: "nvfp4_naive"}
    assert current_paths(model) == {0: None, 1: None}
    set_path(model, gemm.PATHS["nvfp4_minite"])
    assert current_paths(model) == {0: "nvfp4_minite", 1: "nvfp4_minite"}
    set_path(model, None, layers=[0])
    assert current_paths(model) == {0: None, 1: "nvfp4_minite"}
    reset_paths(model)
    assert current_paths(model) == {0: None, 1: None} and "forward" not in ex.__dict__


def test_unknown_path_or_layer_raises_spec_error(model):
    """Unknown path names and layers raise SpecError naming them; nothing is changed."""
    with pytest.raises(SpecError, match="nvfp4_bogus"), use_path(model, "nvfp4_bogus"):
        pass
    with pytest.raises(SpecError, match="nvfp4_bogus"):
        set_path(model, {0: "bf16", 1: "nvfp4_bogus"})
    with pytest.raises(SpecError, match="layer 7"):
        set_path(model, "bf16", layers=[7])
    with pytest.raises(SpecError, match="backend"):
        set_path(model, "bf16", backend="cuda-magic")
    assert current_paths(model) == {0: None, 1: None}


def test_weights_prepared_once_per_version(model, monkeypatch):
    """Quantized stacks are reused across calls and rebuilt when a parameter changes in place."""
    calls = []
    real = gemm.prepare_weights
    monkeypatch.setattr(gemm, "prepare_weights", lambda w, p, **kw: calls.append(p.name) or real(w, p, **kw))
    _, _, ids, mask = _batch(1)
    ex = experts_module(model, 0)
    ex.__dict__.pop("_libalign_weight_cache", None)
    experts_module(model, 1).__dict__.pop("_libalign_weight_cache", None)
    with use_path(model, "nvfp4_minite"):
        _logits(model, ids, mask)
        _logits(model, ids, mask)
        assert len(calls) == 4
        with torch.no_grad():
            ex.down_proj.mul_(1.0)
        _logits(model, ids, mask)
        assert len(calls) == 5
        # New storage (as .to() or load_state_dict(assign=True) give) is seen too.
        ex.down_proj.data = ex.down_proj.data.clone()
        _logits(model, ids, mask)
        assert len(calls) == 6


# --- capture and routing --------------------------------------------------------------------

def test_capture_shapes_and_token_order(model):
    """Capture fills every field with the documented shapes; FC rows are in (token, slot) order."""
    _, _, ids, mask = _batch(2)
    b, t = ids.shape
    cfg = model.config
    k, h, i2 = cfg.num_experts_per_tok, cfg.hidden_size, 2 * cfg.moe_intermediate_size
    with capture(model, [0, 1]) as cap:
        _logits(model, ids, mask)
    assert current_paths(model) == {0: None, 1: None}
    c = cap[1]
    assert c["hidden_in"].shape == c["hidden_out"].shape == (b, t, h)
    assert c["routing"].shape == c["router_weights"].shape == (b * t, k)
    assert c["fc1_out"].shape == (b * t * k, i2) and c["fc2_out"].shape == (b * t * k, h)
    assert c["moe_in"].shape == c["moe_out"].shape == (b * t, h)
    assert torch.equal(cap[0]["hidden_out"], cap[1]["hidden_in"])
    ex = experts_module(model, 1)
    tok, slot = 5, 1
    e = int(c["routing"][tok, slot])
    row = tok * k + slot
    x = c["moe_in"][tok].float()
    want1 = (x @ ex.gate_up_proj[e].float().T).to(torch.bfloat16)
    torch.testing.assert_close(c["fc1_out"][row], want1, rtol=1e-2, atol=1e-3)
    gate, up = c["fc1_out"][row].chunk(2)
    act = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(c["fc2_in"][row], act, rtol=0, atol=0)
    want2 = (act.float() @ ex.down_proj[e].float().T).to(torch.bfloat16)
    torch.testing.assert_close(c["fc2_out"][row], want2, rtol=1e-2, atol=1e-3)
    # The order the observer reports maps token order back to the kernel's expert-sorted rows.
    sorted_experts = c["routing"].reshape(-1)[c["order"]]
    assert torch.all(sorted_experts[1:] >= sorted_experts[:-1])


def test_capture_keep_all_appends_per_forward(model):
    """keep_all=True keeps one entry per forward pass."""
    _, _, ids, mask = _batch(1)
    with capture(model, 0, keep_all=True) as cap:
        _logits(model, ids, mask)
        _logits(model, ids[:, :4], mask[:, :4])
    assert len(cap[0]["hidden_in"]) == 2 and cap[0]["routing"][1].shape[0] == 4


def test_force_routing_changes_which_experts_run(model):
    """Forced assignments replace the router's; forcing the router's own choice changes nothing."""
    _, _, ids, mask = _batch(2)
    with capture(model, [0]) as cap:
        ref = _logits(model, ids, mask)
    natural, weights = cap[0]["routing"], cap[0]["router_weights"]
    e = model.config.num_experts
    shifted = (natural + 3) % e
    with force_routing(model, {0: (shifted, weights)}), capture(model, [0]) as cap2:
        moved = _logits(model, ids, mask)
    assert torch.equal(cap2[0]["routing"], shifted)
    assert not torch.equal(moved, ref)
    with force_routing(model, {0: (natural, weights)}):
        assert torch.equal(_logits(model, ids, mask), ref)
    with force_routing(model, {0: natural}), capture(model, [0]) as cap3:
        same = _logits(model, ids, mask)
    assert torch.equal(same, ref)
    torch.testing.assert_close(cap3[0]["router_weights"], weights, rtol=0, atol=0)
    assert "forward" not in model.model.layers[0].mlp.gate.__dict__
    with pytest.raises(ShapeError), force_routing(model, {0: natural[:3]}):
        _logits(model, ids, mask)
    with pytest.raises(SpecError):
        force_routing(model, {0: natural + e}).__enter__()


# --- learner, sampler, replay ---------------------------------------------------------------

def test_score_sequences_matches_plain_forward(model):
    """Teacher-forced scores equal log-softmax of a plain HF forward gathered at the next tokens."""
    seqs, plens, _, _ = _batch(3)
    got = score_sequences(model, seqs, plens, "bf16", batch_size=1)
    got_batched = score_sequences(model, seqs, plens, "bf16", batch_size=3)
    for s, p, g, gb in zip(seqs, plens, got, got_batched, strict=True):
        ids = torch.tensor([s])
        logp = torch.log_softmax(_logits(model, ids)[0].float(), -1)
        want = logp[p - 1:len(s) - 1].gather(-1, ids[0, p:].unsqueeze(-1)).squeeze(-1)
        assert g.dtype == torch.float32 and g.shape == (len(s) - p,)
        torch.testing.assert_close(g, want, rtol=0, atol=0)
        torch.testing.assert_close(gb, want, rtol=0, atol=2e-2)
    with pytest.raises(InputError):
        score_sequences(model, seqs, [0, 1, 1], "bf16")


@pytest.mark.parametrize("path", ["bf16", "nvfp4_minite"])
def test_generate_logprobs_close_to_teacher_forced(model, path):
    """Greedy sampler log-probs ≈ learner scores of the same sequences on the same path (the floor)."""
    prompts = TASK.prompts(4, 1)
    res = generate(model, prompts, path, max_new_tokens=6, temperature=0, batch_size=4,
                   eos_id=TASK.eos_id)
    assert res.prompt_lens == [len(p) for p in prompts]
    for s, p, lp in zip(res.sequences, prompts, res.logprobs, strict=True):
        assert s[:len(p)] == p and lp.dtype == torch.float32 and lp.shape == (len(s) - len(p),)
        assert 1 <= len(s) - len(p) <= 6
    learner = score_sequences(model, res.sequences, res.prompt_lens, path, batch_size=4)
    diff = torch.cat([a - b for a, b in zip(learner, res.logprobs, strict=True)]).abs()
    assert diff.max() < 0.1
    assert float(diff.mean()) < 0.02


def test_generate_sampling_is_seeded_and_stops_at_eos(model):
    """Same seed, same samples; each completion ends at eos or at max_new_tokens."""
    prompts = TASK.prompts(3, 2)
    a = generate(model, prompts, "bf16", max_new_tokens=5, temperature=1.0, seed=7, batch_size=2)
    b = generate(model, prompts, "bf16", max_new_tokens=5, temperature=1.0, seed=7, batch_size=2)
    assert a.sequences == b.sequences
    for c, f in zip(a.completions, a.finished, strict=True):
        assert (c[-1] == TASK.eos_id) == f and TASK.eos_id not in c[:-1]
        assert f or len(c) == 5


@pytest.mark.parametrize("path", ["bf16", "nvfp4_naive"])
def test_replay_layer_reproduces_capture(model, path):
    """F_X(h_X): replaying the captured input on the capturing path gives the captured output."""
    _seqs, _plens, ids, mask = _batch(3)
    with use_path(model, path), capture(model, [0, 1]) as cap:
        _logits(model, ids, mask)
    for layer in (0, 1):
        c = cap[layer]
        out = replay_layer(model, layer, c["hidden_in"], path, attention_mask=mask)
        assert torch.equal(out, c["hidden_out"])
        forced = replay_layer(model, layer, c["hidden_in"], path, attention_mask=mask,
                              routing=(c["routing"], c["router_weights"]))
        assert torch.equal(forced, c["hidden_out"])
        assert torch.equal(replay_moe(model, layer, c["moe_in"], path), c["moe_out"])
    other = "nvfp4_minite"
    cross = replay_layer(model, 1, cap[1]["hidden_in"], other, attention_mask=mask,
                         routing=cap[1]["routing"])
    assert not torch.equal(cross, cap[1]["hidden_out"])
    assert current_paths(model) == {0: None, 1: None}


# --- trained model cache --------------------------------------------------------------------

def test_trained_cache_round_trip(tmp_path, monkeypatch):
    """steps=5: trains, saves atomically, reloads the same weights; the second call only loads."""
    model, task = trained_tiny_model(cache_dir=tmp_path, steps=5, eval_prompts=4)
    assert isinstance(task, SyntheticTask) and not model.training
    (ckpt,) = [p for p in tmp_path.iterdir()]
    assert ckpt.name.startswith("tiny-") and (ckpt / "model.safetensors").is_file()
    meta = json.loads((ckpt / "training.json").read_text())
    assert meta["steps"] == 5 and set(meta["heldout_accuracy"]) == {"bf16", "nvfp4_naive", "nvfp4_minite"}
    trained, _ = train_mod.train_model(tiny_config(), task, steps=5)
    trained = trained.to(torch.bfloat16)
    for (name, a), (_, b) in zip(model.named_parameters(), trained.named_parameters(), strict=True):
        assert torch.equal(a, b), name

    def no_training(*a, **k):
        raise AssertionError("should load from the cache")

    monkeypatch.setattr(train_mod, "train_model", no_training)
    again, _ = trained_tiny_model(cache_dir=tmp_path, steps=5)
    ids = torch.tensor([TASK.prompts(1, 0)[0]])
    assert torch.equal(_logits(again, ids), _logits(model, ids))


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    """A failure while writing removes the temporary directory and creates no checkpoint."""
    from transformers import Qwen3MoeForCausalLM

    def half_save(model, path, *args, **kwargs):
        (path / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(Qwen3MoeForCausalLM, "save_pretrained", half_save)
    monkeypatch.setattr(train_mod, "EVAL_PATHS", ("bf16",))
    with pytest.raises(OSError, match="disk full"):
        trained_tiny_model(cache_dir=tmp_path, steps=1, eval_prompts=2)
    assert list(tmp_path.iterdir()) == []

    final = tmp_path / "x"

    def interrupted(tmp):
        (tmp / "a").write_text("1")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_dir_atomically(final, interrupted)
    assert list(tmp_path.iterdir()) == []
    write_dir_atomically(final, lambda tmp: (tmp / "a").write_text("1"))
    assert [p.name for p in tmp_path.iterdir()] == ["x"] and (final / "a").read_text() == "1"
    umask = os.umask(0o022)
    os.umask(umask)
    assert final.stat().st_mode & 0o055 == 0o055 & ~umask


def test_atomic_write_keeps_a_checkpoint_another_writer_completed_first(tmp_path):
    """A complete checkpoint renamed into place while ours was written wins (ours is dropped);
    an incomplete directory in the way is an error, left as it is."""
    final = tmp_path / "tiny-abc"

    def theirs_first(tmp):
        (tmp / "config.json").write_text("ours")
        final.mkdir()
        for name in ("config.json", train_mod.META_FILE, "model.safetensors"):
            (final / name).write_text("theirs")

    assert write_dir_atomically(final, theirs_first) == final
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-abc"]
    assert (final / "config.json").read_text() == "theirs"

    other = tmp_path / "tiny-def"

    def half_theirs_first(tmp):
        (tmp / "config.json").write_text("ours")
        other.mkdir()
        (other / "config.json").write_text("theirs")

    with pytest.raises(FileExistsError, match="tiny-def"):
        write_dir_atomically(other, half_theirs_first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-abc", "tiny-def"]
    assert [p.name for p in other.iterdir()] == ["config.json"]


def test_stale_temporary_dirs_of_dead_writers_are_swept(tmp_path):
    """An old temporary directory of a process that no longer exists is removed; a live one stays."""
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc to tell live writers")
    dead = tmp_path / ".tmp-tiny-abc.999999999-1.0000abc1"
    live = tmp_path / f".tmp-tiny-abc.{writer_tag()}.0000abc2"
    for d in (dead, live):
        d.mkdir()
        os.utime(d, (time.time() - 7200,) * 2)
    write_dir_atomically(tmp_path / "tiny-abc", lambda tmp: (tmp / "a").write_text("1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "tiny-abc"])


def test_training_stops_at_the_asked_accuracy(tmp_path, monkeypatch):
    """stop_at_accuracy: training ends at the first step whose last STOP_WINDOW batches reach
    the teacher-forced sequence accuracy; the checkpoint is cached under its own key (the
    full-length key unchanged) and its training.json says where it stopped."""
    monkeypatch.setattr(train_mod, "STOP_WINDOW", 2)
    monkeypatch.setattr(train_mod, "EVAL_PATHS", ("bf16",))
    task = SyntheticTask(max_digits=1)
    cfg = tiny_config(num_hidden_layers=1)
    _, never = train_mod.train_model(cfg, task, steps=6, stop_at_accuracy=1.0)
    assert never[-1]["step"] == 6 and "stopped" not in never[-1]
    _, curve = train_mod.train_model(cfg, task, steps=300, stop_at_accuracy=0.3)
    last = curve[-1]
    assert last["stopped"] and last["step"] < 300 and last["window_seq_acc"] >= 0.3
    full = train_mod.cache_key(cfg, task, 300, 0)
    assert train_mod.cache_key(cfg, task, 300, 0, None) == full
    assert train_mod.cache_key(cfg, task, 300, 0, 0.3) not in (full, train_mod.cache_key(
        cfg, task, 300, 0, 0.4))
    with pytest.raises(ConfigError):
        train_mod.train_model(cfg, task, steps=3, stop_at_accuracy=0.0)
    trained_tiny_model(cache_dir=tmp_path, steps=8, stop_at_accuracy=1.0, eval_prompts=4)
    meta = train_mod.training_report(cache_dir=tmp_path, steps=8, stop_at_accuracy=1.0)
    assert meta["stop_at_accuracy"] == 1.0 and meta["trained_steps"] == 8
    assert train_mod.training_report(cache_dir=tmp_path, steps=8) is None
