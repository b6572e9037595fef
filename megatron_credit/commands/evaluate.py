"""Avg@k, Cons@k and Pass@k of a model on a prompt dataset (``megatron_credit.sources.evaluation``).

    python tools/evaluate.py --hf-dir hf/qwen25-7b-rl --data aime-2024.parquet --k 32 --out report.json
    python tools/evaluate.py --run-dir runs/fipo_qwen25_math_7b --data aime-2024.parquet --k 32 \\
        --engine vllm --engine-option tensor_parallel_size=4
    python tools/evaluate.py --megatron-ckpt ckpt/qwen25-7b --data aime-2024.parquet --k 8

The model: an HF folder (``--hf-dir``), a checkpoint written by ``tools/convert_hf_to_megatron.py``
(``--megatron-ckpt``), or a training run's newest checkpoint (``--run-dir``) / one checkpoint
(``--run-checkpoint``); megatron checkpoints are exported to a temporary HF folder first with the
project's converters. The dataset: DAPO-schema jsonl / parquet (``data_source`` picks the verifier),
prompts longer than ``--max-prompt-len`` dropped. The engine: ``hf`` (``transformers``, CPU or
``--engine-option device=cuda:0``) or ``vllm``; ``--engine-option key=value`` (YAML values) go to its
constructor. Writes a JSON report (``--out``) and a per-problem table (``--table``, tab-separated), and
prints the report. Sampling defaults: temperature 1.0, top-p 1.0 (``--config`` takes them, and the
response budget, from a recipe's ``rollout`` section instead).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The options (``main`` parses with it; the tests walk its actions)."""
    from megatron_credit.cli import nonnegative_int, positive_float, positive_int, ranged
    from megatron_credit.typed_build import Range

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="a Hugging Face model folder")
    src.add_argument("--megatron-ckpt", help="a folder written by tools/convert_hf_to_megatron.py")
    src.add_argument("--run-dir", help="a training run: its newest complete checkpoint")
    src.add_argument("--run-checkpoint", help="one checkpoint of a run: <run>/checkpoints/iter_N")
    p.add_argument("--data", required=True, nargs="+", help="DAPO-schema jsonl / parquet file(s)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    p.add_argument("--k", type=positive_int, default=1, help="samples per problem (Avg@k, Cons@k, Pass@k)")
    p.add_argument("--pass-k", type=positive_int, nargs="*", default=None, help="k values of Pass@k (default 1, 2, 4, .., k)")
    p.add_argument("--config", default=None, help="a recipe: sampling settings from its rollout section")
    p.add_argument("--engine", default=None, help="rollout engine (default: the recipe's, else hf)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine constructor argument (repeatable)")
    p.add_argument("--temperature", type=positive_float, default=None)
    p.add_argument("--top-p", type=ranged(float, Range(gt=0, le=1, note="1 = off")), default=None)
    p.add_argument("--top-k", type=ranged(int, Range(ge=0, note="0 = off")), default=None)
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="response budget (default: the recipe's, else 1024)")
    p.add_argument("--max-prompt-len", type=positive_int, default=None, help="drop longer prompts (default: the recipe's, else 4096)")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N problems")
    p.add_argument("--batch-prompts", type=positive_int, default=8, help="prompts per engine call")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="sampling seed")
    p.add_argument("--reward-workers", type=nonnegative_int, default=0, help="verifier processes (0: in-process)")
    p.add_argument("--out", default=None, help="JSON report path")
    p.add_argument("--table", default=None, help="per-problem table path (tab-separated)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _engine_options(items: list[str]) -> dict:
    import yaml

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option {item!r} is not of the form key=value")
        out[key] = yaml.safe_load(raw)
    return out


@contextlib.contextmanager
def _hf_folder(args):
    """The HF folder to evaluate: ``--hf-dir`` as is, or a megatron checkpoint exported to a temporary one."""
    if args.hf_dir:
        yield args.hf_dir
        return
    with tempfile.TemporaryDirectory(prefix="mc-eval-") as tmp:
        out = str(Path(tmp) / "hf")
        if args.megatron_ckpt:
            from megatron_credit.conversion.converters import convert_megatron_to_hf

            convert_megatron_to_hf(args.megatron_ckpt, out, progress=not args.no_progress)
        else:
            from megatron_credit.conversion.run_export import export_run_checkpoint, newest_checkpoint

            ckpt = args.run_checkpoint or newest_checkpoint(args.run_dir)
            export_run_checkpoint(ckpt, out, run_dir=args.run_dir)
        yield out


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from megatron_credit.data.dataset import load_prompt_dataset
    from megatron_credit.sources.evaluation import problem_table, sample_and_grade, summarize
    from megatron_credit.rollout.engine import build_rollout_engine
    from megatron_credit.rollout.types import SamplingParams

    recipe = None
    if args.config:
        from megatron_credit.recipe.config import load_recipe

        recipe = load_recipe(args.config)
    r = recipe.rollout if recipe else None
    pick = (lambda given, field, default: given if given is not None else (getattr(r, field) if r else default))
    engine_name = pick(args.engine, "engine", "hf")
    options = {**(dict(r.engine_options) if r and engine_name == r.engine else {}),
               **_engine_options(args.engine_option)}
    sampling = SamplingParams(temperature=pick(args.temperature, "temperature", 1.0),
                              top_p=pick(args.top_p, "top_p", 1.0), top_k=pick(args.top_k, "top_k", 0),
                              max_new_tokens=pick(args.max_new_tokens, "max_response_len", 1024), seed=args.seed)
    max_prompt_len = args.max_prompt_len or (recipe.data.max_prompt_len if recipe else 4096)
    pass_ks = args.pass_k or None
    if pass_ks and any(not 1 <= j <= args.k for j in pass_ks):
        raise ValueError(f"--pass-k values must be in [1, --k={args.k}], got {pass_ks}")
    with _hf_folder(args) as hf_dir:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or hf_dir)
        records = load_prompt_dataset(args.data, tokenizer=tokenizer, max_prompt_len=max_prompt_len).records
        records = records[: args.limit] if args.limit else records
        stop = getattr(tokenizer, "eos_token_id", None)
        sampling = _with_stop(sampling, stop)
        verifier_workers = None
        if args.reward_workers:
            from megatron_credit.rewards.verifier_workers import VerifierWorkers, VerifierWorkersConfig

            verifier_workers = VerifierWorkers(VerifierWorkersConfig(num_workers=args.reward_workers))
        engine = build_rollout_engine(engine_name, model_path=hf_dir, **options)
        if recipe is not None:  # a multi-turn recipe (env.name) is evaluated in its environment, as it trained
            from megatron_credit.rollout.multi_turn import build_episode_engine

            engine = build_episode_engine(engine, recipe.env, tokenizer)
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(records), desc="evaluate", unit="problem", file=sys.stderr)
        try:
            problems = sample_and_grade(engine, tokenizer, records, k=args.k, sampling=sampling,
                                        verifier_workers=verifier_workers,
                                        batch_prompts=args.batch_prompts, progress=bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
            engine.close()
            if verifier_workers is not None:
                verifier_workers.close()
    reasons = engine.errors if getattr(engine, "takes_records", False) else {}  # a multi-turn recipe's environment
    for why, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"env {recipe.env.name} failed on {count} trajectories (each graded on its last turn): {why}", file=sys.stderr)
    report = {"model": args.hf_dir or args.megatron_ckpt or args.run_checkpoint or args.run_dir,
              "data": args.data, "engine": engine_name, "temperature": sampling.temperature,
              "top_p": sampling.top_p, "top_k": sampling.top_k, "max_new_tokens": sampling.max_new_tokens,
              "seed": args.seed, **summarize(problems, pass_ks=pass_ks)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    if args.table:
        Path(args.table).write_text(problem_table(problems, pass_ks=pass_ks), encoding="utf-8")
    return 0


def _with_stop(sampling, eos):
    import dataclasses

    return sampling if eos is None else dataclasses.replace(sampling, stop_token_ids=(int(eos),))


def main(argv=None) -> int:
    """User errors: one ``error: ...`` line, exit code 2 (``--debug``: the traceback)."""
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
