"""A multi-turn draw's time with ``env.lockstep`` true and false, when one step in eight is slow.

    python benchmarks/env_draw.py [--sleep 2.0] [--repeats 2]

Eight trajectories of three turns each (the HF engine on the project's tiny random Qwen2, ``TINY_QWEN2``, four
tokens a turn, no stop token, so every trajectory plays its three turns) in an environment whose step appends a
two-token observation and, at turn ``k``, sleeps ``--sleep`` seconds on trajectory ``k`` only: each turn has one
slow step, each trajectory at most one. In lockstep (``env.lockstep: true``) every turn waits for its slowest
step, so the draw takes about three sleeps plus the generation (the sum of per-turn maxima); without it
(the default) a trajectory's next turn is generated as soon as its own step returned, so the slow steps
overlap and the draw takes about the slowest trajectory's own time, one sleep plus the generation
(docs/multi_turn.md). Prints the median draw seconds of each mode, the time besides generating, their ratio,
and whether both drew the same tokens (the seeds pick them, not the order the steps end in).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

TRAJECTORIES, TURNS, EOS = 8, 3, 2


class Ids:
    """Token ids as text (``"3 17 42"``): the observations' tokenizer."""

    eos_token_id, pad_token_id = EOS, 0

    def encode(self, text, add_special_tokens=False):
        return [int(x) for x in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(int(i)) for i in ids)


class Timed:
    """The wrapped engine, keeping the seconds its ``generate`` calls took."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def generate(self, prompts, params, *, group_ids=None):
        t0 = time.perf_counter()
        try:
            return self.engine.generate(prompts, params, group_ids=group_ids)
        finally:
            self.seconds += time.perf_counter() - t0


def environment(sleep_s: float):
    from megatron_credit.env import Environment, StepResult

    class OneSlowPerTurn(Environment):
        """Three turns, an observation after each; trajectory ``k``'s step sleeps at its turn ``k``."""

        def start(self, record):
            return {"turns": 0, "k": int(record.uid)}

        def step(self, state, action):
            if state["k"] == state["turns"]:
                time.sleep(sleep_s)
            state["turns"] += 1
            return StepResult(observation="60 61", done=state["turns"] >= TURNS)

    return OneSlowPerTurn(OneSlowPerTurn.Config())


def draw(engine, sleep_s: float, *, lockstep: bool, seed: int):
    """(seconds of the draw, of which generating, the trajectories' response ids)."""
    from megatron_credit.data.records import ChatMessage, PromptRecord
    from megatron_credit.rollout import SamplingParams
    from megatron_credit.rollout.multi_turn import EpisodeEngine

    timed = Timed(engine)
    episodes = EpisodeEngine(timed, environment(sleep_s), Ids(), max_turns=TURNS, max_total_tokens=64,
                             step_timeout_s=60.0, threads=TRAJECTORIES, vocab_size=128, lockstep=lockstep)
    prompts = [[3 + k, 17, 42 - k] for k in range(TRAJECTORIES)]
    records = [PromptRecord(uid=str(k), data_source="synthetic_arith",
                            messages=(ChatMessage(role="user", content="x"),), ground_truth="1")
               for k in range(TRAJECTORIES)]
    params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(), n=1, seed=seed)
    t0 = time.perf_counter()
    batch = episodes.generate(prompts, params, group_ids=list(range(TRAJECTORIES)), records=records)
    wall = time.perf_counter() - t0
    episodes._executor.shutdown()
    assert all(s.episode.turns == TURNS for s in batch.samples)
    return wall, timed.seconds, [s.response_ids for s in batch.samples]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleep", type=float, default=2.0, help="seconds the slow step of each turn sleeps")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import Qwen2Config

    from megatron_credit.recipe.config import TINY_QWEN2
    from megatron_credit.rollout import HFRolloutEngine

    engine = HFRolloutEngine(hf_config=Qwen2Config(**{k: v for k, v in TINY_QWEN2.items() if k != "model_type"}),
                             init_seed=0)
    draw(engine, 0.0, lockstep=False, seed=0)  # warm-up: the first forward passes
    print(f"{TRAJECTORIES} trajectories x {TURNS} turns, tiny Qwen2 (HF engine), one step in eight sleeps "
          f"{args.sleep:g} s per turn (a different trajectory each turn), threads={torch.get_num_threads()}")
    results = {}
    for lockstep in (True, False):
        runs = [draw(engine, args.sleep, lockstep=lockstep, seed=r) for r in range(args.repeats)]
        wall = statistics.median(r[0] for r in runs)
        gen = statistics.median(r[1] for r in runs)
        results[lockstep] = (wall, gen, [r[2] for r in runs])
        print(f"  env.lockstep={str(lockstep).lower():<5}: draw {wall:.2f} s, of which generating {gen:.2f} s, "
              f"besides generating {wall - gen:.2f} s (runs: {', '.join(f'{r[0]:.2f}' for r in runs)})")
    (lw, lg, lt), (fw, fg, ft) = results[True], results[False]
    print(f"lockstep / not: draw {lw / fw:.2f}x; besides generating {lw - lg:.2f} s against {fw - fg:.2f} s (the sum "
          f"of the per-turn maxima is {TURNS} x {args.sleep:g} s; without lockstep the slow steps overlap the others' "
          f"turns); same tokens: {lt == ft}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
