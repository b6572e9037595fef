"""Evaluation metrics against brute-force references, and ``tools/evaluate.py`` end to end: an HF folder
and the same model as a converted megatron checkpoint give the same report."""
from __future__ import annotations

import itertools
import json
import random
from math import comb

import pytest

from megatron_credit.sources.evaluation import (ProblemResult, default_pass_ks, majority_answer, means_from_sums,
                                        metric_sums, pass_at_k, problem_table, summarize)


def _pass_at_k_enumerated(correct: list[bool], k: int) -> float:
    """The probability that a uniformly drawn k-subset holds a correct sample, by enumerating subsets."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_subset_enumeration(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n=n, c=c, k=k) == pytest.approx(_pass_at_k_enumerated(correct, k), abs=1e-12)
            assert pass_at_k(n=n, c=c, k=k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    assert pass_at_k(n=1000, c=3, k=500) == pytest.approx(1 - comb(997, 500) / comb(1000, 500), rel=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(n=4, c=1, k=5)


def _majority_reference(answers):
    """Count every answer, keep the largest count, and break ties by the first index: a loop."""
    best, best_count = None, 0
    for i, a in enumerate(answers):
        if a is None:
            continue
        count = sum(1 for b in answers if b == a)
        if count > best_count:
            best, best_count = a, count
    return best


def test_majority_vote_against_a_loop():
    rng = random.Random(0)
    for _ in range(300):
        answers = [rng.choice(["1", "2", "3", None]) for _ in range(rng.randint(1, 9))]
        assert majority_answer(answers) == _majority_reference(answers)
    assert majority_answer([None, None]) is None
    assert majority_answer(["b", "a", "a", "b"]) == "b"  # tie: first seen


def _problems():
    rng = random.Random(1)
    out = []
    for i in range(20):
        gt = str(rng.randint(0, 3))
        answers = tuple(rng.choice(["0", "1", "2", "3", None]) for _ in range(6))
        out.append(ProblemResult(uid=f"p{i}", ground_truth=gt, answers=answers,
                                 correct=tuple(a == gt for a in answers), response_lens=(5,) * 6))
    return out


def test_summary_matches_per_problem_references():
    problems = _problems()
    report = summarize(problems, pass_ks=(1, 3, 6))
    avg = sum(sum(p.correct) / 6 for p in problems) / 20
    cons = sum(float(_majority_reference(p.answers) == p.ground_truth) for p in problems) / 20
    assert report["k"] == 6 and report["num_problems"] == 20
    assert report["avg@6"] == pytest.approx(avg, abs=1e-12) and report["cons@6"] == pytest.approx(cons, abs=1e-12)
    for j in (1, 3, 6):
        ref = sum(_pass_at_k_enumerated(list(p.correct), j) for p in problems) / 20
        assert report[f"pass@{j}"] == pytest.approx(ref, abs=1e-12)
    assert report["pass@1"] == pytest.approx(report["avg@6"], abs=1e-12)
    # Data-parallel ranks: sums over any split, added, give the same means.
    a, b = metric_sums(problems[:7], k=6), metric_sums(problems[7:], k=6)
    means = means_from_sums({name: a[name] + b[name] for name in a})
    assert means == pytest.approx({"avg@6": report["avg@6"], "cons@6": report["cons@6"], "pass@6": report["pass@6"]})
    table = problem_table(problems, pass_ks=(1, 6)).splitlines()
    assert table[0].split("\t") == ["uid", "ground_truth", "correct", "k", "majority_answer", "cons", "pass@1", "pass@6"]
    assert len(table) == 21 and table[1].split("\t")[2] == str(sum(problems[0].correct))
    assert default_pass_ks(32) == (1, 2, 4, 8, 16, 32)


def _tiny_hf_model(out_dir: str) -> None:
    import torch
    import transformers

    from tests.support.runs import char_tokenizer

    char_tokenizer(out_dir)
    cfg = transformers.AutoConfig.for_model("qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out_dir)


def test_evaluate_cli_hf_dir_and_megatron_checkpoint_agree(tmp_path, capsys):
    from megatron_credit.conversion.converters import convert_hf_to_megatron
    from megatron_credit.commands.evaluate import main

    hf = str(tmp_path / "hf")
    _tiny_hf_model(hf)
    rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
             "reward_model": {"ground_truth": str(a + b)}} for a in range(3) for b in range(2)]
    with open(tmp_path / "test.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    common = ["--data", str(tmp_path / "test.jsonl"), "--k", "4", "--max-new-tokens", "6", "--max-prompt-len", "64",
              "--batch-prompts", "4", "--seed", "3", "--no-progress"]
    assert main(["--hf-dir", hf, *common, "--out", str(tmp_path / "a.json"), "--table", str(tmp_path / "a.tsv")]) == 0
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["num_problems"] == 6 and report["k"] == 4
    assert set(report) >= {"avg@4", "cons@4", "pass@1", "pass@2", "pass@4", "response_length/mean"}
    table = (tmp_path / "a.tsv").read_text().splitlines()
    assert len(table) == 7
    assert report["avg@4"] == pytest.approx(sum(int(line.split("\t")[2]) for line in table[1:]) / 24)
    convert_hf_to_megatron(hf, tmp_path / "mc", progress=False)
    capsys.readouterr()
    assert main(["--megatron-ckpt", str(tmp_path / "mc"), *common, "--tokenizer", hf,
                 "--out", str(tmp_path / "b.json")]) == 0
    other = json.loads((tmp_path / "b.json").read_text())
    assert {k: v for k, v in other.items() if k != "model"} == {k: v for k, v in report.items() if k != "model"}
    assert main(["--hf-dir", hf, *common, "--pass-k", "8"]) == 2
    assert "--pass-k values must be in [1, --k=4]" in capsys.readouterr().err
