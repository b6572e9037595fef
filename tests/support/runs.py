"""What the tests that run the trainer share: the tiny recipes, the in-process run (in a pool worker), the
command line, and one reader of ``metrics.jsonl`` (one home each, instead of private helpers that
test files imported from one another).

- :data:`TINY` (a 2-layer Qwen2 from an inline architecture, a short cached warm-up, 2 iterations) and
  :func:`train_tiny`, which trains it through ``megatron_credit.trainer.loop.train`` where it is called
  (a one-rank gloo worker of a ``DistributedPool``: module level, so the spawned worker finds it);
- :data:`TINY_CHECKPOINTED` (the same model, no warm-up, a checkpoint after each iteration) for runs made
  through the command line; :data:`CLI_TINY`, the overrides of the demo recipe the resume tests use;
- :func:`run_pretrain_rl`: ``pretrain_rl.py`` in a subprocess; :func:`subprocess_env`: its environment;
  :func:`run_until_exit`: a command to its end, failing only on a silence (a hang), never on its duration;
- :func:`metrics_rows`: every row of a run's ``metrics.jsonl`` (each line must be JSON: a stray line fails
  the test that reads it); :func:`stable`: the rows without the wall-clock metrics (:data:`VOLATILE`);
- :func:`char_tokenizer`: a character-level ``transformers`` tokenizer with a chat template, built offline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO, ROOT

TINY = {
    "model": {"architecture": dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False)},
    # A short supervised warm-up (cached per run directory's parent) so that groups have mixed outcomes.
    "warmup": {"steps": 30, "batch_size": 32, "lr": 3e-3},
    "rollout": {"prompts_per_step": 8, "n": 4, "max_response_len": 4},
    "optim": {"lr": 1e-3},
    "train": {"steps": 2, "num_minibatches": 2, "val_every": 2, "val_prompts": 8},
    # Checkpoints are megatron torch_dist saves, whose writer needs a non-daemonic process: the pool's
    # workers are daemonic, so runs that checkpoint are tested through the command line
    # (:func:`run_pretrain_rl`, :data:`TINY_CHECKPOINTED`).
    "checkpoint": {"every": 0, "keep": 2, "save_at_end": False},
    "logging": {"tensorboard": False, "progress": False, "plots": False},
}
VOLATILE = ("time/", "throughput/", "sync/seconds")  # wall-clock metrics differ between runs


def tiny_recipe_file(tmp_path, cache: str, **sections) -> str:
    """:data:`TINY` with ``sections`` merged in, as ``tmp_path / "recipe.yaml"``; the warm-up cached in
    ``tmp_path.parent / cache`` (shared by a module's tests)."""
    import yaml

    d = {k: dict(v) for k, v in TINY.items()}
    d["warmup"]["cache_dir"] = str(tmp_path.parent / cache)
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def train_tiny(run_dir: str, resume: str = "auto", overrides=()):
    """Train :data:`TINY` (with ``overrides``) into ``run_dir`` in this process; the rows it logged. The warm-up
    is cached next to ``run_dir``."""
    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import train

    cache = os.path.join(os.path.dirname(run_dir), "warmup-cache")
    recipe = recipe_from_dict(TINY, overrides=[f"warmup.cache_dir={cache}", *overrides])
    device = distributed.initialize(recipe.parallel, seed=recipe.seed, timeout_s=recipe.distributed.timeout_s)
    try:
        return train(recipe, recipe.model.hf_config(), run_dir=run_dir, device=device, resume=resume,
                     log=lambda *a: None)
    finally:
        distributed.destroy()


def stable(rows):
    """The rows without their wall-clock metrics (:data:`VOLATILE`), which differ between identical runs."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def metrics_rows(run_dir) -> list[dict]:
    """Every row of ``<run_dir>/metrics.jsonl``, in file order."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


TINY_CHECKPOINTED = {
    "model": {"architecture": dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False)},
    "rollout": {"prompts_per_step": 8, "n": 4, "max_response_len": 4},
    "optim": {"lr": 1e-3},
    "train": {"steps": 2, "num_minibatches": 2},
    "checkpoint": {"every": 1, "keep": 3},
    "logging": {"tensorboard": False, "progress": False, "plots": False},
}


def subprocess_env(**extra: str) -> dict:
    """This environment with the repository first on ``PYTHONPATH`` and one intra-op thread (2 cores in CI)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                OMP_NUM_THREADS="1", **extra)


def run_pretrain_rl(*args, timeout=600) -> subprocess.CompletedProcess:
    """``pretrain_rl.py *args`` in a subprocess run from the repository root; its output is captured."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=timeout)


def run_until_exit(cmd, *, env: dict, cwd=ROOT, silence_s: float = 600.0) -> subprocess.CompletedProcess:
    """``cmd`` to its end, however long it takes while it writes, with its output captured: a wait for a
    condition (the exit), not for a time. Only a process (or its children) silent for ``silence_s`` seconds
    is taken for hung: its whole process group is killed and the test fails naming the silence (a run on
    two cores shared with other jobs is slow, not silent)."""
    import signal
    import threading
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                            start_new_session=True)  # its own group: a hung torchrun is killed with its workers
    chunks: dict[str, list[str]] = {"out": [], "err": []}
    last = [time.monotonic()]

    def read(stream, into):
        for line in iter(stream.readline, ""):
            into.append(line)
            last[0] = time.monotonic()

    readers = [threading.Thread(target=read, args=(proc.stdout, chunks["out"]), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, chunks["err"]), daemon=True)]
    for t in readers:
        t.start()
    while proc.poll() is None:
        if time.monotonic() - last[0] > silence_s:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"{cmd[:4]}... wrote nothing for {silence_s:g} s: taken for hung and killed; "
                                 f"its last output:\n{''.join((chunks['out'] + chunks['err'])[-40:])}")
        time.sleep(0.5)
    for t in readers:
        t.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(chunks["out"]), "".join(chunks["err"]))


# The lr schedule crosses warm-up (steps 0-1), decay (2-4) and its floor (5-7): 2 optimizer steps per iteration,
# so the checkpoint of iteration 2 is mid-decay and the resumed run must continue the schedule.
CLI_TINY = ["warmup.steps=0", "train.val_every=0", "rollout.prompts_per_step=8", "logging.progress=false",
            "logging.plots=false", "algorithm.name=ppo", "checkpoint.every=2", "optim.warmup_steps=2",
            "optim.schedule=cosine", "optim.decay_steps=3", "optim.min_lr=1e-4"]


def char_tokenizer(out_dir: str) -> None:
    """A character-level ``transformers`` tokenizer with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("0123456789+-=: ?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,")
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<eos>", "<user>", "<assistant>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<user>{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(out_dir)

