"""CPU tests of the `transformers` rollout engine on a tiny random Qwen2."""
import pytest
import torch
from transformers import Qwen2Config

from megatron_credit.rollout import (
    ROLLOUT_ENGINES,
    FinishStatus,
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    build_rollout_engine,
)
from megatron_credit.rollout.sampling import filter_logits

VOCAB, MAX_POS = 96, 48


def _config(**overrides) -> Qwen2Config:
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=MAX_POS, initializer_range=0.3,
                  tie_word_embeddings=False)
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def _engine(init_seed=0, **overrides) -> HFRolloutEngine:
    return HFRolloutEngine(hf_config=_config(**overrides), init_seed=init_seed)


@pytest.fixture(scope="module")
def engine():
    return _engine()


PROMPTS = [[3, 17, 42], [5, 6, 7, 8, 9, 10, 11], [60], [12, 13, 14, 15]]


def _teacher_forced_logits(model, sample) -> torch.Tensor:
    """[len(response), V] float64 logits predicting each response token, from one full forward."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    p = len(sample.prompt_ids)
    return logits[p - 1 : p - 1 + len(sample.response_ids)]


def _as_tuples(batch):
    return [(s.group_id, s.sample_index, s.response_ids, s.status) for s in batch.samples]


def test_registry_and_protocol(engine):
    assert ROLLOUT_ENGINES.names() == ["hf", "vllm"]
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match=r"valid names: \['hf', 'vllm'\]"):
        build_rollout_engine("sglang")
    built = build_rollout_engine("hf", hf_config=_config(), init_seed=0)
    sd, ref = built.model.state_dict(), engine.model.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)  # init_seed makes the random init reproducible


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_equal_teacher_forced_forward(engine, mode):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, n=3, seed=11,
                            logprobs_mode=mode)
    batch = engine.generate(PROMPTS, params, group_ids=[10, 11, 12, 13])
    assert len(batch) == len(PROMPTS) * 3
    assert [(s.group_id, s.sample_index) for s in batch.samples] == [(g, j) for g in (10, 11, 12, 13) for j in range(3)]
    for s in batch.samples:
        assert s.logprobs_mode == mode and s.logprobs.dtype == torch.float32
        scaled = _teacher_forced_logits(engine.model, s) / 0.7
        if mode == "processed":
            scaled = filter_logits(scaled, top_k=20, top_p=0.9)
        want = torch.log_softmax(scaled, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert torch.isfinite(want).all(), "a sampled token lies outside the top-k/top-p set"
        torch.testing.assert_close(s.logprobs.double(), want, rtol=0, atol=1e-5)


def test_stop_tokens_and_max_length(engine):
    stop = tuple(range(0, VOCAB, 4))  # a quarter of the vocabulary: many samples stop early, some run out
    params = SamplingParams(max_new_tokens=6, n=8, seed=0, stop_token_ids=stop)
    batch = engine.generate(PROMPTS, params)
    statuses = {s.status for s in batch.samples}
    assert statuses == {FinishStatus.STOPPED, FinishStatus.TRUNCATED}
    for s in batch.samples:
        early = [t for t in s.response_ids[:-1] if t in stop]
        assert not early, "generation continued past a stop token"
        if s.status == FinishStatus.STOPPED:
            assert s.response_ids[-1] in stop and 1 <= len(s.response_ids) <= 6
        else:
            assert len(s.response_ids) == 6 and s.response_ids[-1] not in stop
        assert s.error == "" and 0 < s.timings.first_token_s <= s.timings.finish_s <= batch.wall_s


def test_stop_token_on_the_last_allowed_step_is_stopped(engine):
    """The vLLM engine agrees (vLLM itself says "length" there): see tests/rollout/test_vllm_engine_rules.py."""
    free = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=5)).samples[0].response_ids
    last = free[4]
    k = free.index(last)  # the greedy stream is the same with a stop token until that token appears
    stopped = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=k + 1,
                                                           stop_token_ids=[last])).samples[0]
    assert stopped.response_ids == free[: k + 1] and stopped.status == FinishStatus.STOPPED
    # The same at the model's context limit (the budget capped by max_position_embeddings).
    prompt = list(range(1, MAX_POS - k))  # room for k + 1 tokens
    free = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=20)).samples[0].response_ids
    assert len(free) == k + 1
    k = free.index(free[-1])
    stopped = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=20,
                                                       stop_token_ids=[free[-1]])).samples[0]
    assert stopped.response_ids == free[: k + 1] and stopped.status == FinishStatus.STOPPED


def test_model_context_truncates_and_overlong_prompt_fails(engine):
    near_full = list(range(1, MAX_POS - 2))  # room for 3 tokens
    too_long = list(range(1, MAX_POS + 1))
    batch = engine.generate([near_full, too_long, [7]], SamplingParams(max_new_tokens=10, n=2, seed=1))
    a, b, c = batch.samples[0:2], batch.samples[2:4], batch.samples[4:6]
    assert all(s.status == FinishStatus.TRUNCATED and len(s.response_ids) == 3 for s in a)
    assert all(s.status == FinishStatus.FAILED and s.response_ids == [] and "context" in s.error for s in b)
    assert all(s.status == FinishStatus.TRUNCATED and len(s.response_ids) == 10 for s in c)


def test_non_finite_logits_fail_the_sample():
    eng = _engine()
    sd = eng.model.state_dict()
    eng.update_weights([[("lm_head.weight", torch.full_like(sd["lm_head.weight"], float("nan")))]], strict=False)
    batch = eng.generate([[1, 2]], SamplingParams(max_new_tokens=4, n=2, seed=0))
    assert all(s.status == FinishStatus.FAILED and s.response_ids == [] and "non-finite" in s.error
               for s in batch.samples)


def test_top_k_1_and_greedy_equal_argmax(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    top1 = engine.generate(PROMPTS, SamplingParams(top_k=1, max_new_tokens=8, seed=5))
    assert [s.response_ids for s in greedy.samples] == [s.response_ids for s in top1.samples]
    for s in greedy.samples:
        logits = _teacher_forced_logits(engine.model, s)
        assert s.response_ids == logits.argmax(-1).tolist()
        want = torch.log_softmax(logits, -1).max(-1).values
        torch.testing.assert_close(s.logprobs.double(), want, rtol=0, atol=1e-5)


def test_seeds_reproduce(engine):
    params = SamplingParams(max_new_tokens=10, n=4, seed=123)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert _as_tuples(a) == _as_tuples(b)
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a.samples, b.samples))
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, n=4, seed=124))
    assert [s.response_ids for s in a.samples] != [s.response_ids for s in c.samples]
    # The n samples of one prompt differ from each other (independent streams).
    assert len({tuple(s.response_ids) for s in a.samples[:4]}) == 4


def test_left_padding_and_batch_composition_do_not_change_results(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=10, n=3, seed=7)
    batched = engine.generate(PROMPTS, params, group_ids=[0, 1, 2, 3])
    chunked = HFRolloutEngine(model=engine.model, max_batch_size=4).generate(PROMPTS, params, group_ids=[0, 1, 2, 3])
    alone = [s for i, p in enumerate(PROMPTS) for s in engine.generate([p], params, group_ids=[i]).samples]
    for other in (chunked.samples, alone):
        assert [(s.group_id, s.sample_index, s.response_ids) for s in other] == \
               [(s.group_id, s.sample_index, s.response_ids) for s in batched.samples]
        for x, y in zip(batched.samples, other):
            torch.testing.assert_close(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-5)  # float32 kernels


def _buckets(state_dict, size):
    items = list(state_dict.items())
    return [items[i : i + size] for i in range(0, len(items), size)]


def test_update_weights_equals_loading_the_state_dict():
    params = SamplingParams(max_new_tokens=10, n=2, seed=3)
    target = _engine(init_seed=1)
    new_sd = {k: v.clone() for k, v in target.model.state_dict().items()}
    eng = _engine(init_seed=0)
    before = eng.generate(PROMPTS, params)
    assert eng.update_weights(iter(_buckets(new_sd, 5))) == len(new_sd)
    after = eng.generate(PROMPTS, params)
    loaded = _engine(init_seed=0)
    loaded.model.load_state_dict(new_sd)
    reference = loaded.generate(PROMPTS, params)
    assert [s.response_ids for s in after.samples] != [s.response_ids for s in before.samples]
    assert _as_tuples(after) == _as_tuples(reference)
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(after.samples, reference.samples))
    # Tensors of another dtype are cast on copy (the actor streams bf16 on GPU).
    eng.update_weights([[(k, v.double()) for k, v in new_sd.items()]])
    assert _as_tuples(eng.generate(PROMPTS, params)) == _as_tuples(reference)


def test_update_weights_errors_name_the_tensor():
    eng = _engine()
    sd = eng.model.state_dict()
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=r"unknown parameter 'model\.layers\.9\.mlp\.up_proj\.weight'"):
        eng.update_weights([[("model.layers.9.mlp.up_proj.weight", sd[name])]])
    with pytest.raises(ValueError, match=rf"shape mismatch for '{name}': got \(3, 3\), model has \(64, 32\)"):
        eng.update_weights([[(name, torch.zeros(3, 3))]])
    # A bad bucket is checked before any of it is copied.
    old = sd["model.norm.weight"].clone()
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        eng.update_weights([[("model.norm.weight", torch.zeros_like(old)), ("nope", torch.zeros(1))]])
    assert torch.equal(eng.model.state_dict()["model.norm.weight"], old)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) of the rollout model received no tensor, "
                                         r"e\.g\. \['lm_head\.weight'\]"):
        eng.update_weights([[(k, v) for k, v in sd.items() if k != "lm_head.weight"]])


def test_tied_embeddings_are_covered_by_either_name():
    eng = _engine(tie_word_embeddings=True)
    sd = eng.model.state_dict()
    new = torch.randn_like(sd["model.embed_tokens.weight"])
    stream = [(k, v) for k, v in sd.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")]
    assert eng.update_weights([stream, [("model.embed_tokens.weight", new)]]) == len(stream) + 1
    assert torch.equal(eng.model.lm_head.weight, new)


def test_sleep_wake_close():
    eng = _engine()
    params = SamplingParams(max_new_tokens=4, seed=0)
    before = eng.generate(PROMPTS, params)
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(PROMPTS, params)
    eng.wake_up()
    assert _as_tuples(eng.generate(PROMPTS, params)) == _as_tuples(before)
    # The colocated order: sleep, (train), wake the weights, sync, wake the KV cache. Weights are never
    # pushed into a sleeping engine.
    other = _engine(init_seed=2)
    eng.sleep()
    with pytest.raises(RuntimeError, match=r"weights are asleep: call wake_up\(\['weights'\]\)"):
        eng.update_weights([list(other.model.state_dict().items())])
    eng.wake_up(["weights"])
    eng.update_weights([list(other.model.state_dict().items())])
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(PROMPTS, params)  # the KV cache still sleeps
    eng.wake_up(["kv_cache"])
    assert _as_tuples(eng.generate(PROMPTS, params)) == _as_tuples(other.generate(PROMPTS, params))
    with pytest.raises(ValueError, match="wake_up tags"):
        eng.wake_up(["kv"])
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(PROMPTS, params)


def test_user_errors(engine):
    assert len(engine.generate([], SamplingParams())) == 0
    with pytest.raises(ValueError, match="group_ids has 1 entries for 4 prompts"):
        engine.generate(PROMPTS, SamplingParams(), group_ids=[0])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="exactly one of"):
        HFRolloutEngine(model=engine.model, hf_config=_config())


def test_compacting_finished_rows_does_not_change_results(engine):
    params = SamplingParams(max_new_tokens=12, n=6, seed=9, stop_token_ids=tuple(range(0, VOCAB, 5)))
    compact = engine.generate(PROMPTS, params)
    lengths = sorted(len(s.response_ids) for s in compact.samples)
    assert lengths[0] < 4 and lengths[-1] == 12, "the test needs rows that finish early and rows that run on"
    full = HFRolloutEngine(model=engine.model, compact_finished=False).generate(PROMPTS, params)
    assert _as_tuples(compact) == _as_tuples(full)
    for x, y in zip(compact.samples, full.samples):
        torch.testing.assert_close(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-5)
    for s in compact.samples:  # and still the model's own log-probs
        want = torch.log_softmax(_teacher_forced_logits(engine.model, s), -1)
        want = want.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(s.logprobs.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("swap_after", [0, 2, 5])
def test_new_weights_between_decode_steps_continue_the_responses(swap_after):
    # A partial rollout: after decode step `swap_after` the weights become another model's. The tokens sampled
    # before are those of the first model (the same seeds); each later token's log-prob is the second model's
    # on the whole prefix (prompt and response so far), computed again; responses continue, none restarts.
    first, second = _engine(init_seed=0), _engine(init_seed=1)
    new = [[(k, v.clone()) for k, v in second.model.state_dict().items()]]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5, stop_token_ids=())
    alone = first.generate(PROMPTS, params)
    engine, steps = _engine(init_seed=0), []

    def between_steps():
        steps.append(1)
        if len(steps) == swap_after + 1:
            engine.update_weights(iter(new))
            return True
        return False

    engine.between_steps = between_steps
    batch = engine.generate(PROMPTS, params)
    cut = swap_after + 1  # tokens 0..swap_after were sampled before the swap
    for s, a in zip(batch.samples, alone.samples):
        assert len(s.response_ids) == 8 and s.response_ids[:cut] == a.response_ids[:cut]
        torch.testing.assert_close(s.logprobs[:cut], a.logprobs[:cut], rtol=0, atol=0)
        want = torch.log_softmax(_teacher_forced_logits(second.model, s), -1).gather(
            -1, torch.tensor(s.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(s.logprobs[cut:].double(), want[cut:], rtol=0, atol=1e-5)
    assert any(s.response_ids != a.response_ids for s, a in zip(batch.samples, alone.samples))


def test_per_call_seeds_give_valid_reproducible_samples(engine):
    # One generator per call (rollout.seed_mode: per_call): valid samples with the engine's log-probs,
    # reproducible for a fixed seed and engine setup; no longer the per-sample streams.
    per_call = HFRolloutEngine(model=engine.model, seed_mode="per_call", max_batch_size=8)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10, n=3, seed=5)
    a, b = per_call.generate(PROMPTS, params, group_ids=[4, 5, 6, 7]), \
        per_call.generate(PROMPTS, params, group_ids=[4, 5, 6, 7])
    assert _as_tuples(a) == _as_tuples(b) and all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a.samples, b.samples))
    assert [(s.group_id, s.sample_index) for s in a.samples] == [(g, j) for g in (4, 5, 6, 7) for j in range(3)]
    for s in a.samples:
        assert s.status != FinishStatus.FAILED and len(s.response_ids) >= 1
        scaled = _teacher_forced_logits(engine.model, s) / 0.7
        want = torch.log_softmax(scaled, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert torch.isfinite(filter_logits(scaled, top_k=20, top_p=0.9).gather(
            -1, torch.tensor(s.response_ids)[:, None])).all()  # every token inside the top-k/top-p set
        torch.testing.assert_close(s.logprobs.double(), want, rtol=0, atol=1e-5)
    per_sample = HFRolloutEngine(model=engine.model, max_batch_size=8).generate(PROMPTS, params, group_ids=[4, 5, 6, 7])
    assert engine.seed_mode == "per_sample" and _as_tuples(per_sample) != _as_tuples(a)
    other = per_call.generate(PROMPTS, SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10, n=3,
                                                      seed=6), group_ids=[4, 5, 6, 7])
    assert [s.response_ids for s in other.samples] != [s.response_ids for s in a.samples]
    with pytest.raises(ValueError, match=r"rollout.seed_mode must be one of \('auto', 'per_sample', 'per_call'\)"):
        HFRolloutEngine(model=engine.model, seed_mode="per_batch")
