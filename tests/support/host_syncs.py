"""Device-to-host reads of the trainer's update, counted on the emulated accelerator (``tests/support/fakegpu.py``).

:func:`count_update_reads` runs, in a pool worker, the update of ``tests/support/fixed_batch.py`` (behaviour
pass, advantages, two mini-batches with their optimizer steps and metrics) for each algorithm under
:func:`~tests.support.fakegpu.counting_reads`, with phases:

- ``update``: inside ``Actor.run`` with gradients (megatron's forward-backward schedule over the
  micro-batches of a mini-batch, the loss included);
- ``logprob``: inside ``Actor.run`` without gradients (the behaviour pass: old log-probs, values, captures);
- ``iteration``: the rest of the step (``step.behaviour_pass``, ``step.compute_advantages``,
  ``step.update_minibatch``: the optimizer step and the metrics, ``metrics.sums.Reduction``).

Each result is per algorithm (and ``grpo:moe``, GRPO on a tiny mixture of experts): the project's own reads per micro-batch of each pass, its reads in the whole
iteration (all phases), and megatron-core's reads by call site (counted apart: they are megatron's).
Used by tests/trainer/test_host_syncs.py and ``benchmarks/host_syncs.py``.
"""
from __future__ import annotations

import contextlib
import functools

ALGORITHMS = {"grpo": [], "dapo": [], "dr_grpo": [], "rloo": [], "gspo": [], "fipo": [],
              "ppo": [], "comppo": ["algorithm.params.critic_layers=1"]}
MOE = dict(model_type="qwen3_moe", vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
           tie_word_embeddings=False)
"""``grpo:moe``: GRPO on a tiny mixture of experts (4 experts, top-2): its router monitor and aux losses."""
SCENARIOS = {**{name: (name, overrides, None) for name, overrides in ALGORITHMS.items()}, "grpo:moe": ("grpo", [], MOE)}
LOCAL = ["model.transformer_impl=local"]  # the emulated machine has no Transformer Engine
MAX_TOKENS = 48
"""Tokens per micro-batch: two rows of the fixed batch, so each pass runs several micro-batches."""


@contextlib.contextmanager
def _phases(reads, counts: dict):
    """Label reads by phase (see the module docstring); ``counts[phase]`` gets the micro-batches run."""
    from unittest import mock

    from megatron_credit.trainer import step
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.metrics.sums import Reduction

    run = Actor.run

    def labelled_run(self, microbatches, *args, forward_only: bool, **kwargs):
        label = "logprob" if forward_only else "update"
        counts[label] = counts.get(label, 0) + len(microbatches)
        with reads.phase(label):
            return run(self, microbatches, *args, forward_only=forward_only, **kwargs)

    def in_iteration(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with reads.phase("iteration"):
                return fn(*args, **kwargs)
        return wrapped

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(Actor, "run", labelled_run))
        for name in ("behaviour_pass", "compute_advantages", "update_minibatch"):
            stack.enter_context(mock.patch.object(step, name, in_iteration(getattr(step, name))))
        stack.enter_context(mock.patch.object(Reduction, "__call__", in_iteration(Reduction.__call__)))
        yield


def _summary(reads, counts: dict) -> dict:
    mb = {p: max(1, counts.get(p, 0)) for p in ("update", "logprob")}
    phases = ("update", "logprob", "iteration")
    project = sum(reads.count(owner="project", phase=p) for p in phases)
    core = sum(reads.count(owner="megatron-core", phase=p) for p in phases)
    return {
        "microbatches": {p: counts.get(p, 0) for p in ("update", "logprob")},
        "update_microbatch": reads.count(owner="project", phase="update") / mb["update"],
        "logprob_microbatch": reads.count(owner="project", phase="logprob") / mb["logprob"],
        "iteration": project,
        "project_sites": {p: reads.sites(owner="project", phase=p) for p in phases},
        "megatron_core": {"update_microbatch": reads.count(owner="megatron-core", phase="update") / mb["update"],
                          "logprob_microbatch": reads.count(owner="megatron-core", phase="logprob") / mb["logprob"],
                          "iteration": core,
                          "sites": {p: reads.sites(owner="megatron-core", phase=p) for p in phases}},
    }


def count_update_reads(algorithms=None) -> dict:
    """``{algorithm: summary}`` (see the module docstring); run it in a fresh process (a ``DistributedPool``
    worker of world size 1): the emulated backend's registration is process-wide."""
    from tests.support.fakegpu import counting_reads, fake_cuda
    from tests.support.fixed_batch import _run_fixed

    out = {}
    for name in algorithms or SCENARIOS:
        algorithm, overrides, arch = SCENARIOS[name]
        counts: dict = {}
        with fake_cuda(), counting_reads() as reads, _phases(reads, counts):
            _run_fixed({}, algorithm, max_tokens=MAX_TOKENS, overrides=overrides + LOCAL, arch=arch)
        out[name] = _summary(reads, counts)
    return out
