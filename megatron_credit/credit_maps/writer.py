"""Credit maps: K sampled responses of an iteration, token by token, with every per-token quantity of their
credit (``docs/credit_maps.md``).

Every ``logging.credit_map_every`` iterations the trainer hands :class:`CreditMaps` the batch and its credit
(``trainer/step.credit_view``: the applied advantage, the algorithm's own factors, the log-prob change,
the critic's values, the TIS weights). It picks K responses (:func:`select_rows`: the best and the worst of
a group with mixed outcomes, the one whose credit is most uneven, and at least one of each outcome), and
writes ``credit_maps/iter_<N>.jsonl`` (one response per line: the tokens and every quantity,
:func:`response_records`) and the page rendered from it (``credit_maps/page.py``). Only the rank
that holds DP rank 0's rows whole writes (the last pipeline stage's TP rank 0, CP rank 0): the K
responses are chosen among its rows, so nothing crosses a process boundary. Off (``credit_map_every: 0``), nothing here runs.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import torch

from megatron_credit.credit.diagnostics import per_response
from megatron_credit.credit_maps.page import render_page


def map_path(run_dir: str, iteration: int, ext: str) -> str:
    """``run_dir/credit_maps/iter_<NNNNNNN>.<ext>``."""
    return os.path.join(run_dir, "credit_maps", f"iter_{iteration:07d}.{ext}")


def select_rows(rewards: torch.Tensor, correct: torch.Tensor, group_ids: torch.Tensor, k: int,
                unevenness: "torch.Tensor | None" = None) -> list[tuple[int, str]]:
    """``k`` rows (fewer if the batch is smaller) and why each was chosen: the best and the worst response
    of one group (one with mixed outcomes when there is one; then the group whose credit is most uneven,
    ``unevenness: [N]`` per row, e.g. the Gini of its applied advantage, with ``-1`` for a row without
    credit; then the widest spread of rewards; then the first), then rows of the outcome seen less so far
    (at least one correct and one incorrect when the batch has both): rows with credit, other groups, the
    most uneven credit first, then in row order.

    >>> select_rows(torch.tensor([1., 0., 1., 0., 0., 0.]), torch.tensor([1, 0, 1, 0, 0, 0]).bool(),
    ...             torch.tensor([0, 0, 1, 1, 2, 2]), 3)
    [(0, 'best of its group'), (1, 'worst of its group'), (2, 'correct')]
    """
    r, ok, g = rewards.double().tolist(), correct.bool().tolist(), group_ids.tolist()
    u = [0.0] * len(r) if unevenness is None else unevenness.double().tolist()
    groups: dict[int, list[int]] = {}
    for i, gid in enumerate(g):
        groups.setdefault(gid, []).append(i)
    best_g = max(groups, key=lambda gid: (len({ok[i] for i in groups[gid]}) > 1, max(u[i] for i in groups[gid]),
                                          max(r[i] for i in groups[gid]) - min(r[i] for i in groups[gid]),
                                          -groups[gid][0]))
    rows = groups[best_g]
    top, bottom = max(rows, key=lambda i: (r[i], -i)), min(rows, key=lambda i: (r[i], i))
    chosen = [(top, "best of its group")]
    if bottom != top:
        chosen.append((bottom, "worst of its group"))
    while len(chosen) < min(k, len(r)):
        taken = {i for i, _ in chosen}
        seen = [ok[i] for i, _ in chosen]
        want_correct = seen.count(True) <= seen.count(False)  # the outcome seen less (correct on a tie)
        taken_groups = {g[j] for j in taken}
        rest = [i for i in range(len(r)) if i not in taken]
        order = sorted(rest, key=lambda i: (ok[i] != want_correct, u[i] < 0, g[i] in taken_groups, -u[i], i))
        i = order[0]
        chosen.append((i, "correct" if ok[i] else "incorrect"))
    return chosen[:k]


def response_records(batch: Any, fields: Mapping[str, torch.Tensor], rows: Sequence[tuple[int, str]], *,
                     tokenizer: Any, iteration: int, algorithm: str) -> list[dict]:
    """One JSON-ready record per chosen row: its prompt (decoded), reward, verdict, why it was chosen, and
    its response tokens in order from the first scored token to the last (``tokens``: each decoded alone,
    ``token_ids``), ``observation[t]`` for a token inside the span that the loss does not score (a
    multi-turn trajectory's observation), and ``fields[name][t]``: the value of each per-token quantity
    at that token (label space: position ``t`` of the batch scores ``labels[t]``, ``batch/train_batch.py``)."""
    out = []
    for row, why in rows:
        m = batch.loss_mask[row].bool()
        pos = m.nonzero().flatten()
        lo, hi = (int(pos[0]), int(pos[-1]) + 1) if len(pos) else (0, 0)
        ids = batch.labels[row, lo:hi].tolist()
        out.append({
            "iteration": iteration, "algorithm": algorithm, "row": row, "chosen": why,
            "group": int(batch.group_ids[row]), "reward": float(batch.rewards[row]),
            "correct": bool(batch.correct[row]),
            "prompt": tokenizer.decode(batch.input_ids[row, : lo + 1].tolist(), skip_special_tokens=False),
            "tokens": [tokenizer.decode([i], skip_special_tokens=False) for i in ids], "token_ids": ids,
            "observation": [not bool(x) for x in m[lo:hi]],
            "fields": {name: [round(float(x), 6) for x in v[row, lo:hi]] for name, v in fields.items()},
        })
    return out


def write_records(records: list[dict], path: str) -> None:
    """``records`` as JSON lines, written whole then renamed (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    os.replace(path + ".tmp", path)


def read_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_page(records: list[dict], path: str, *, title: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(render_page(records, title=title))
    os.replace(path + ".tmp", path)


class CreditMaps:
    """The credit-map writer of one run (module docstring)."""

    def __init__(self, run_dir: str, *, every: int, samples: int, tokenizer: Any, algorithm: str) -> None:
        self.run_dir, self.every, self.samples = run_dir, int(every), int(samples)
        self.tokenizer, self.algorithm = tokenizer, algorithm

    def due(self, iteration: int) -> bool:
        return self.every > 0 and iteration % self.every == 0

    @staticmethod
    def holds_data(actor: Any) -> bool:
        """This rank holds DP rank 0's rows whole, with their credit (last stage, TP rank 0, CP rank 0)."""
        return actor.last_stage and actor.dp_rank == 0 and actor.tp_rank == 0 and actor.cp_rank == 0

    def write(self, iteration: int, batch: Any, fields: Mapping[str, torch.Tensor]) -> str:
        """The iteration's ``.jsonl`` and ``.html``; returns the page's path."""
        d = per_response(fields["advantage"], batch.loss_mask)
        unevenness = torch.where(d["has_credit"], d["gini"], -1.0)
        rows = select_rows(batch.rewards, batch.correct, batch.group_ids, self.samples, unevenness)
        records = response_records(batch, fields, rows, tokenizer=self.tokenizer, iteration=iteration,
                                   algorithm=self.algorithm)
        write_records(records, map_path(self.run_dir, iteration, "jsonl"))
        page = map_path(self.run_dir, iteration, "html")
        write_page(records, page, title=f"{self.algorithm}: credit map of iteration {iteration}")
        return page
