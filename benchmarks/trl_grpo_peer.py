"""Peer timing: TRL's GRPOTrainer on the demo's shape (tiny Qwen2, two-digit addition, CPU, fp32).

    python benchmarks/trl_grpo_peer.py [--steps 5] [--seed 0]

Runs in its own environment with ``trl`` installed (torch CPU, transformers, accelerate, datasets); it does
not import ``megatron_credit`` and nothing imports it. Shape, as in ``examples/demo_cpu.yaml``: randomly
initialised ``Qwen2ForCausalLM`` (vocab 64, hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads,
untied embeddings), 64 prompts x 8 completions per generation batch, ``max_completion_length`` 6,
temperature 1.0, AdamW lr 2e-4 (constant), grad clip 1.0, beta 0 (no reference model), and two optimizer
steps of 256 completions per generation batch (``per_device_train_batch_size=256``,
``steps_per_generation=2``, ``num_iterations=1``), so TRL recomputes the old log-probs once per batch,
as our trainer does.

One "step" below is one RL iteration = one generation batch of 512 completions = two TRL optimizer steps
(``trainer.state.global_step`` advances by 2). The printed figure is the mean wall seconds per RL
iteration over iterations 2..N (the first, warm-up, iteration excluded), with the share spent in
``_generate_and_score_completions`` (generation + reward + old log-probs) beside it; each iteration's
process CPU seconds are printed too (less sensitive than wall time to a shared machine's load).

Prompts are ``"a+b=Answer:"`` with a, b in 10..99 (our recipe's prompt is ``a+b=`` plus the chat
template's ``Answer:`` generation prompt); the tokenizer is character-level (``tokenizers`` WordLevel,
built offline) with the task's characters, ``<pad>``, ``<eos>``, and unused filler tokens up to 64 so the
model's vocabulary equals ours. Reward: +1 if the completion's leading integer equals a+b, else -1.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

VOCAB_SIZE = 64
PROMPTS_PER_STEP = 64
NUM_GENERATIONS = 8
MINI_BATCHES = 2
ANSWER_PREFIX = "Answer:"
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def build_tokenizer() -> PreTrainedTokenizerFast:
    chars = sorted(set("0123456789+= " + ANSWER_PREFIX))
    specials = ["<pad>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    for k in range(len(vocab), VOCAB_SIZE):
        vocab[f"<unused{k}>"] = k  # fillers: the model's vocab is 64 like ours; sampled fillers score -1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")
    assert len(fast) == VOCAB_SIZE, len(fast)
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, torch_dtype=torch.float32,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_dataset(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows["prompt"].append(f"{a}+{b}={ANSWER_PREFIX}")
        rows["answer"].append(a + b)
    return Dataset.from_dict(rows)


def addition_reward(prompts, completions, answer, **_):
    out = []
    for completion, target in zip(completions, answer):
        m = _LEADING_INT.match(completion)
        out.append(1.0 if m is not None and int(m.group(1)) == int(target) else -1.0)
    return out


class IterationTimer(TrainerCallback):
    """Wall time at the end of every MINI_BATCHES-th optimizer step (one RL iteration)."""

    def __init__(self):
        self.marks: list[float] = []
        self.cpu_marks: list[float] = []
        self.start = self.cpu_start = None

    def on_train_begin(self, args, state, control, **kw):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % MINI_BATCHES == 0:
            self.marks.append(time.perf_counter())
            self.cpu_marks.append(time.process_time())


class TimedGRPOTrainer(GRPOTrainer):
    """Records the wall time of each generation batch's generate + score + old-log-prob pass."""

    gen_times: list[float] = []

    def _generate_and_score_completions(self, inputs):
        t = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.gen_times.append(time.perf_counter() - t)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="RL iterations (generation batches); >= 2")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first is warm-up)")

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    dataset = build_dataset(PROMPTS_PER_STEP * (args.steps + 1), args.seed)
    gen_batch = PROMPTS_PER_STEP * NUM_GENERATIONS
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True, bf16=False, fp16=False,
            per_device_train_batch_size=gen_batch // MINI_BATCHES,  # 256 completions per optimizer step
            gradient_accumulation_steps=1,
            steps_per_generation=MINI_BATCHES,  # generation batch = 512 = 64 prompts x 8
            num_iterations=1,
            num_generations=NUM_GENERATIONS,
            max_completion_length=6,
            temperature=1.0, top_p=1.0, top_k=0,
            learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
            beta=0.0,
            use_vllm=False,
            max_steps=MINI_BATCHES * args.steps,
            report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, seed=args.seed, data_seed=args.seed,
        )
        timer = IterationTimer()
        trainer = TimedGRPOTrainer(model=model, reward_funcs=addition_reward, args=config,
                                   train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    marks = [timer.start] + timer.marks
    per_iter = [b - a for a, b in zip(marks, marks[1:])]
    steady = per_iter[1:]
    cpu_marks = [timer.cpu_start] + timer.cpu_marks
    per_iter_cpu = [b - a for a, b in zip(cpu_marks, cpu_marks[1:])]
    gen = TimedGRPOTrainer.gen_times[1:len(per_iter)]
    a = trainer.args
    print(f"trl GRPOTrainer: per_device_train_batch_size={a.per_device_train_batch_size} "
          f"steps_per_generation={a.steps_per_generation} generation_batch_size={a.generation_batch_size} "
          f"num_generations={a.num_generations} num_iterations={a.num_iterations} loss_type={a.loss_type} "
          f"scale_rewards={a.scale_rewards} beta={a.beta} vocab={len(tokenizer)} threads={torch.get_num_threads()}")
    print("per-iteration seconds: " + " ".join(f"{x:.3f}" for x in per_iter))
    print("per-iteration process CPU seconds: " + " ".join(f"{x:.3f}" for x in per_iter_cpu))
    print(f"generate+score+old_logp seconds (iterations 2..): " + " ".join(f"{x:.3f}" for x in gen))
    print(f"mean_s_per_step {statistics.mean(steady):.4f} (RL iterations 2..{len(per_iter)}, "
          f"gen+score {statistics.mean(gen):.4f}, train {statistics.mean(steady) - statistics.mean(gen):.4f})")


if __name__ == "__main__":
    main()
