"""CompPO's gate statistics of a checkpoint on a dataset, beside the paper's (Qwen3-4B on math).

    python tools/gate_stats.py --model models/smollm2-135m --data examples/data/smollm2_task.jsonl \
        [--prompts 16 --samples 4 --max-new-tokens 48 --sink-keys 1]

The model (an HF folder: an imported or exported checkpoint) samples responses to the dataset's prompts
(temperature 1), the dataset's verifier scores them, and a teacher-forced forward records the final
layer's query / key heads after RoPE (a ``transformers`` attention function that calls SDPA unchanged).
From them :func:`megatron_credit.models.concentration.attention_concentration` (the kernel the
trainer's final-layer capture runs) gives ``H`` and ``n`` of every response query, and
:func:`megatron_credit.credit.gates.comppo_gate` the gate ``kappa`` (0.1, 0.9, tau 4, the recipe
defaults), once as the paper defines it and once with the first ``--sink-keys`` positions left out of
``H`` (``algorithm.params.gate_sink_keys``). Printed: mean, median, IQR, the mean gate in the first /
middle / last third of each response, correct vs incorrect responses, and the sink share of ``H``
(``sum_{j < k} a_j**2 / sum_j a_j**2``, head-mean, over all response queries, from a dense softmax).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PAPER = {"mean": 0.61, "median": 0.63, "iqr": 0.18, "first": 0.52, "mid": 0.63, "last": 0.68}
"""CompPO's reported gate statistics on Qwen3-4B (math)."""
ROWS = ("mean", "median", "iqr", "first", "mid", "last", "correct", "incorrect", "sink_share")


def summarize(kappa: list[torch.Tensor], correct: list[bool]) -> dict[str, float]:
    """Statistics of per-response gates ``kappa[i]: [T_i]``: mean, median, IQR over all tokens, the mean
    gate per third of relative position (token ``t`` of ``T`` is in third ``floor(3 t / T)``, the
    trainer's ``comppo/gate_first|mid|last``), and the token-mean over correct / incorrect responses.

    >>> s = summarize([torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 0.7, 0.9])], [True, False])
    >>> [round(s[k], 4) for k in ("mean", "median", "first", "last", "correct", "incorrect")]
    [0.45, 0.4, 0.3, 0.6, 0.2, 0.7]
    """
    flat = torch.cat(kappa).double()
    q = torch.quantile(flat, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    out = {"mean": flat.mean().item(), "median": q[1].item(), "iqr": (q[2] - q[0]).item()}
    for i, name in enumerate(("first", "mid", "last")):
        sel = [k.double()[(3 * torch.arange(len(k)) // len(k)) == i] for k in kappa]
        out[name] = torch.cat(sel).mean().item()
    for name, want in (("correct", True), ("incorrect", False)):
        sel = [k.double() for k, c in zip(kappa, correct) if c == want]
        out[name] = torch.cat(sel).mean().item() if sel else float("nan")
    return out


class _FinalLayerQK:
    """A ``transformers`` attention function that keeps the last layer's ``query [B, Hq, T, D]`` and
    ``key [B, Hkv, T, D]`` (after RoPE) while armed, and returns SDPA's output unchanged."""

    name = "mc_final_layer_qk"

    def __init__(self, last_layer: int):
        self.last_layer, self.armed, self.qk = last_layer, False, None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.armed and getattr(module, "layer_idx", None) == self.last_layer:
            self.qk = (query.detach(), key.detach(), float(kwargs.get("scaling") or module.scaling))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _sink_share(q, k, scale: float, positions: torch.Tensor, sink_keys: int) -> tuple[float, float]:
    """``(sum over queries and heads of sum_{j<k} a_j**2, of sum_j a_j**2)`` from a dense float64 softmax."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale  # [1, Hq, m, T]
    s = s.masked_fill(torch.arange(k.shape[2])[None, :] > positions[:, None], float("-inf"))
    a2 = torch.softmax(s, dim=-1) ** 2
    return a2[..., :sink_keys].sum().item(), a2.sum().item()


def gate_tables(model_dir: str, data: str, *, prompts: int, samples: int, max_new_tokens: int,
                sink_keys: int, seed: int = 0, max_prompt_len: int = 512) -> dict[str, dict[str, float]]:
    """``{"paper": PAPER, "ours": {...}, "ours_no_sinks": {...}}`` (see the module docstring)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from megatron_credit.credit.gates import comppo_gate
    from megatron_credit.data.dataset import load_prompt_dataset
    from megatron_credit.models.concentration import attention_concentration
    from megatron_credit.rewards.base import method_for_data_source
    from megatron_credit.rewards.math import compute_score  # importing it registers the verifiers

    if sink_keys < 1:
        raise ValueError(f"--sink-keys must be >= 1, got {sink_keys}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hook = _FinalLayerQK(model.config.num_hidden_layers - 1)
    AttentionInterface.register(hook.name, hook)
    model.set_attn_implementation(hook.name)
    records = load_prompt_dataset([data], tokenizer=tok, max_prompt_len=max_prompt_len).records[:prompts]
    kappa = {"ours": [], "ours_no_sinks": []}
    correct, sink, total = [], 0.0, 0.0
    torch.manual_seed(seed)
    for rec in records:
        ids = torch.tensor([rec.prompt_ids])
        p = ids.shape[1]
        with torch.no_grad():
            rows = ids.repeat(samples, 1)  # one prompt, no padding: the mask is all ones (said, not inferred)
            out = model.generate(rows, attention_mask=torch.ones_like(rows), max_new_tokens=max_new_tokens, do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, pad_token_id=tok.pad_token_id)
        method = method_for_data_source(rec.data_source)
        for row in out:
            resp = row[p:]
            stop = (resp == tok.eos_token_id).nonzero()
            resp = resp[: int(stop[0]) + 1] if len(stop) else resp
            if len(resp) < 1:
                continue
            text = tok.decode(resp, skip_special_tokens=True)
            correct.append(compute_score(text, rec.ground_truth, method=method).correct)
            seq = torch.cat([ids[0], resp])[None, :-1]  # queries p-1 .. L-2 predict the response tokens
            hook.armed = True
            with torch.no_grad():
                model(input_ids=seq)
            hook.armed = False
            q, k, scale = hook.qk
            pos = torch.arange(p - 1, seq.shape[1])
            for name, sinks in (("ours", 0), ("ours_no_sinks", sink_keys)):
                h, n = attention_concentration(q[:, :, p - 1:], k, scale=scale, q_positions=pos, sink_keys=sinks)
                kappa[name].append(comppo_gate(h, n)[0])
            a, b = _sink_share(q[:, :, p - 1:], k, scale, pos, sink_keys)
            sink, total = sink + a, total + b
    if not correct:
        raise ValueError(f"{data}: no response was scored (empty responses?)")
    tables = {"paper": dict(PAPER)}
    for name, gates in kappa.items():
        tables[name] = summarize(gates, correct)
    tables["ours"]["sink_share"] = sink / total
    tables["ours"]["accuracy"] = sum(correct) / len(correct)
    tables["ours"]["responses"] = len(correct)
    return tables


def format_tables(tables: dict[str, dict[str, float]], *, sink_keys: int) -> str:
    cols = [("paper (Qwen3-4B)", "paper"), ("ours", "ours"), (f"ours, first {sink_keys} keys out", "ours_no_sinks")]
    lines = [f"{'statistic':<12}" + "".join(f"{c:>26}" for c, _ in cols)]
    for row in ROWS:
        cells = [tables[key].get(row) for _, key in cols]
        lines.append(f"{row:<12}" + "".join(f"{'-' if v is None else f'{v:.3f}':>26}" for v in cells))
    o = tables["ours"]
    lines.append(f"({o['responses']} sampled responses, accuracy {o['accuracy']:.3f}; sink_share: the share of H "
                 f"that the first {sink_keys} keys supply)")
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF folder (config.json, safetensors, tokenizer)")
    p.add_argument("--data", required=True, help="DAPO-schema jsonl / parquet of prompts")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="sampled responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--sink-keys", type=int, default=1, help="attention-sink keys (first positions) to leave out")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name in ("prompts", "samples", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tables = gate_tables(a.model, a.data, prompts=a.prompts, samples=a.samples, max_new_tokens=a.max_new_tokens,
                         sink_keys=a.sink_keys, seed=a.seed)
    print(format_tables(tables, sink_keys=a.sink_keys))
    return 0


def main(argv=None) -> int:
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
