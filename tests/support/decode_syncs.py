"""Device-to-host reads of the HF rollout engine's decode loop, counted on the emulated accelerator
(``tests/support/fakegpu.py``).

:func:`count_decode_reads` builds tiny random models on ``device="cuda"`` inside
:func:`~tests.support.fakegpu.fake_cuda`, generates with :class:`HFRolloutEngine` under
:func:`~tests.support.fakegpu.counting_reads`, and cuts the recorded reads at each decode step: a step begins
where its noise is drawn (``ExponentialNoise.next``) or, greedy, where ``sample_step`` is called, and the last
one ends where ``_to_samples`` reads the results back. Reads before the first step are the pre-fill and the
set-up; ``_to_samples``'s are the results read once per call. A step covers everything the loop does for
one token: sampling, the per-row bookkeeping, compaction when it happens, the model's forward and the MoE
routing record.

Scenarios (:data:`SCENARIOS`): sampling with top-k/top-p at a fixed number of steps (no stop token), rows
that stop early so that finished rows leave the batch (compaction), greedy, one generator per call, and a
tiny mixture of experts (its routing recorded every step); :func:`cpu_samples` gives the same scenarios'
samples on the CPU. Used by tests/rollout/test_hf_decode_syncs.py;
run it in a fresh process (a ``DistributedPool`` worker of world size 1): the emulated backend's
registration is process-wide.
"""
from __future__ import annotations

import contextlib

VOCAB = 96
DENSE = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
             tie_word_embeddings=False)
MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
           tie_word_embeddings=False, experts_implementation="batched_mm")
"""tests/rollout/test_hf_engine_routing.py's model; the eager experts: on a device that is not the CPU
transformers picks its grouped kernel, whose ``histc`` of integers the emulated device (the CPU) lacks."""
PROMPTS = [[3, 17, 42], [5, 6, 7, 8, 9, 10, 11], [60]]
SCENARIOS = {
    # name: (model, engine options, sampling parameters)
    "sampling": (DENSE, {}, dict(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=6, n=3, seed=1,
                                 stop_token_ids=())),
    "early_stop": (DENSE, {}, dict(temperature=1.0, max_new_tokens=8, n=4, seed=9,
                                   stop_token_ids=tuple(range(0, VOCAB, 4)))),
    "greedy": (DENSE, {}, dict(temperature=0.0, max_new_tokens=4, n=1, seed=0, stop_token_ids=())),
    "per_call": (DENSE, {"seed_mode": "per_call"}, dict(temperature=1.0, max_new_tokens=6, n=2, seed=3,
                                                        stop_token_ids=tuple(range(0, VOCAB, 6)))),
    "moe": (MOE, {}, dict(temperature=1.0, max_new_tokens=6, n=2, seed=5, stop_token_ids=(7, 11, 19))),
}


@contextlib.contextmanager
def _step_marks(reads, marks: list, compactions: list):
    """Append ``len(reads.events)`` to ``marks`` where each decode step begins, and once more where the
    results are read back (``_to_samples``); count the compactions (``ExponentialNoise.select``)."""
    from unittest import mock

    from megatron_credit.rollout import hf_engine
    from megatron_credit.rollout.sampling import ExponentialNoise

    state = {"open": False}  # the step's noise was drawn: sample_step does not begin another one
    sample_step, next_noise, select, to_samples = (hf_engine.sample_step, ExponentialNoise.next,
                                                   ExponentialNoise.select, hf_engine.HFRolloutEngine._to_samples)

    def noise(self):
        if not state["open"]:
            marks.append(len(reads.events))
            state["open"] = True
        return next_noise(self)

    def step(*args, **kwargs):
        if not state["open"]:
            marks.append(len(reads.events))
        state["open"] = False
        return sample_step(*args, **kwargs)

    def compact(self, *args, **kwargs):
        compactions.append(len(marks))
        return select(self, *args, **kwargs)

    def results(*args, **kwargs):
        marks.append(len(reads.events))
        return to_samples(*args, **kwargs)

    with mock.patch.object(hf_engine, "sample_step", step), mock.patch.object(ExponentialNoise, "next", noise), \
            mock.patch.object(ExponentialNoise, "select", compact), \
            mock.patch.object(hf_engine.HFRolloutEngine, "_to_samples", staticmethod(results)):
        yield


def _per_step(events, marks: list, owner: str) -> list[int]:
    return [sum(1 for e in events[a:b] if e[1] == owner) for a, b in zip(marks, marks[1:])]


def _sites(events, owner: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, o, site, _ in events:
        if o == owner:
            out[f"{site} {kind}"] = out.get(f"{site} {kind}", 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _samples(batch) -> list:
    return [(s.response_ids, s.logprobs.tolist(), int(s.status)) for s in batch.samples]


def cpu_samples(scenarios=None) -> dict:
    """``{scenario: [(response ids, log-probs, status)]}`` of the same engines on the CPU, for comparison: the
    emulated device computes on the CPU with CPU generators of the same seeds."""
    from megatron_credit.rollout.hf_engine import HFRolloutEngine
    from megatron_credit.rollout.types import SamplingParams

    out = {}
    for name in scenarios or SCENARIOS:
        model, options, params = SCENARIOS[name]
        engine = HFRolloutEngine(hf_config=dict(model), init_seed=0, **options)
        out[name] = _samples(engine.generate(PROMPTS, SamplingParams(**params)))
    return out


def _scenario(name: str) -> dict:
    import torch

    from megatron_credit.rollout.hf_engine import HFRolloutEngine
    from megatron_credit.rollout.types import SamplingParams
    from tests.support.fakegpu import counting_reads

    model, options, params = SCENARIOS[name]
    engine = HFRolloutEngine(hf_config=dict(model), device="cuda", init_seed=0, **options)
    assert engine.device.type == "cuda" and next(engine.model.parameters()).device.type == "fakegpu"
    marks: list[int] = []
    compactions: list[int] = []
    with counting_reads() as reads, _step_marks(reads, marks, compactions):
        batch = engine.generate(PROMPTS, SamplingParams(**params))
    steps = len(marks) - 1
    decode = reads.events[marks[0]:marks[-1]]
    project, hf = _per_step(reads.events, marks, "project"), _per_step(reads.events, marks, "transformers")
    return {
        "steps": steps,
        "compactions": len(compactions),
        "lengths": sorted(len(s.response_ids) for s in batch.samples),
        "samples": _samples(batch),
        "project_per_step": project,
        "transformers_per_step": hf,
        "project_setup": sum(1 for e in reads.events[:marks[0]] if e[1] == "project"),
        "project_results": sum(1 for e in reads.events[marks[-1]:] if e[1] == "project"),
        "sites": {"project": _sites(decode, "project"), "transformers": _sites(decode, "transformers"),
                  "other": _sites(decode, "other")},
        "torch": torch.__version__,
    }


def count_decode_reads(scenarios=None) -> dict:
    """Reads per decode step of the HF engine (see the module docstring)::

        {"hf_decode_step": {"max": .., "mean": ..}, "transformers_decode_step": {"max": .., "mean": ..},
         "sites": {scenario: {"project": {site: n}, "transformers": ..., "other": ...}},
         "scenarios": {scenario: {"steps", "compactions", "project_per_step", ...}}}

    the first two over every step of every scenario. Run it in a fresh process (module docstring)."""
    from tests.support.fakegpu import fake_cuda

    per = {}
    with fake_cuda():
        for name in scenarios or SCENARIOS:
            per[name] = _scenario(name)

    def summary(key: str) -> dict:
        counts = [c for s in per.values() for c in s[key]]
        return {"max": max(counts), "mean": sum(counts) / len(counts)}

    return {"hf_decode_step": summary("project_per_step"), "transformers_decode_step": summary("transformers_per_step"),
            "sites": {name: s["sites"] for name, s in per.items()}, "scenarios": per}
