"""The credit map as a page and as a picture, from the records of ``credit_maps/writer.response_records``.

:func:`render_page` makes one self-contained HTML page: no script at all and nothing from the network.
The quantity that colours the tokens is chosen with radio buttons and CSS alone (each token carries one
colour per quantity as a CSS variable; the checked button picks which one paints), and hovering a token
shows all its numbers (its ``title``). Every text from the run (prompt, tokens, field names) is
HTML-escaped, so a response that writes ``<script>`` shows it as text.

Colours: a quantity with a negative value on the page is diverging around 0 (red > 0, blue < 0, scaled
by the largest magnitude); one that is never negative (``f_t``, ``kappa``, weights) goes from white at its
smallest value on the page to purple at its largest. Tokens the loss does not score (a multi-turn
trajectory's observations) are grey and dashed, whatever the quantity.

:func:`render_png` draws one response coloured by one quantity with matplotlib (for papers). Standard
library only, matplotlib imported there.
"""
from __future__ import annotations

import html
import math
from typing import Sequence

_POS, _NEG, _SEQ = (214, 39, 40), (31, 119, 180), (117, 68, 170)


def field_names(records: Sequence[dict]) -> list[str]:
    """Every quantity of ``records``, in the order they first appear."""
    out: list[str] = []
    for rec in records:
        out += [k for k in rec["fields"] if k not in out]
    return out


def field_scale(records: Sequence[dict], name: str) -> tuple[float, float]:
    """(smallest, largest) finite value of quantity ``name`` over the scored tokens of ``records``."""
    vals = [v for rec in records for v, obs in zip(rec["fields"].get(name, ()), rec["observation"])
            if not obs and v is not None and math.isfinite(v)]
    return (min(vals), max(vals)) if vals else (0.0, 0.0)


def colour(v: float, lo: float, hi: float) -> tuple[int, int, int]:
    """The RGB colour of value ``v`` on a page whose values span ``[lo, hi]`` (module docstring).

    >>> colour(1.0, -2.0, 2.0), colour(-2.0, -2.0, -1.0), colour(1.1, 1.0, 1.2), colour(5.0, 5.0, 5.0)
    ((234, 147, 148), (31, 119, 180), (186, 161, 212), (255, 255, 255))
    """
    if v is None or not math.isfinite(v):
        return (255, 255, 255)
    if lo < 0:
        t, end = min(abs(v) / max(abs(lo), abs(hi)), 1.0), (_POS if v > 0 else _NEG)
    else:
        t, end = ((v - lo) / (hi - lo) if hi > lo else 0.0), _SEQ
    t = min(max(t, 0.0), 1.0)
    return tuple(round(255 + t * (c - 255)) for c in end)


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def _token_span(rec: dict, t: int, names: Sequence[str], scales) -> str:
    text = rec["tokens"][t]
    shown = html.escape(text.replace("\n", "\u21b5\n") if text else "\u2205")
    nums = [f"{n} = {_num(rec['fields'][n][t])}" for n in names if n in rec["fields"]]
    tip = html.escape(f"token {t}: {text!r} (id {rec['token_ids'][t]})\n" + "\n".join(nums), quote=True)
    if rec["observation"][t]:
        return f'<span class="t obs" title="{tip}">{shown}</span>'
    style = ";".join(f"--c{i}:rgb{colour(rec['fields'][n][t], *scales[n])}" for i, n in enumerate(names)
                     if n in rec["fields"])
    return f'<span class="t" style="{style}" title="{tip}">{shown}</span>'


def _response(rec: dict, names: Sequence[str], scales) -> str:
    verdict = "correct" if rec["correct"] else "incorrect"
    head = (f'<div class="head"><b>{html.escape(str(rec["chosen"]))}</b> &middot; row {int(rec["row"])}, group '
            f'{int(rec["group"])} &middot; reward <b>{rec["reward"]:+.4g}</b> &middot; '
            f'<span class="{verdict}">{verdict}</span> &middot; {len(rec["tokens"])} tokens</div>')
    prompt = f'<pre class="prompt">{html.escape(rec["prompt"])}</pre>'
    tokens = "".join(_token_span(rec, t, names, scales) for t in range(len(rec["tokens"])))
    return f'<section>{head}{prompt}<div class="resp">{tokens}</div></section>'


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;max-width:70em;color:#222}
section{border:1px solid #ccc;border-radius:6px;padding:.6em .9em;margin:1em 0}
.head{margin-bottom:.3em}.correct{color:#1a7f37;font-weight:bold}.incorrect{color:#b42318;font-weight:bold}
pre.prompt{background:#f5f5f5;padding:.4em;white-space:pre-wrap;margin:.3em 0}
.resp{font-family:ui-monospace,monospace;line-height:2;white-space:pre-wrap}
.t{padding:2px 1px;margin:0 1px;border-radius:3px;border:1px solid #ddd}
.t.obs{background:#e6e6e6;border:1px dashed #999;color:#666;font-style:italic}
.t:hover{outline:2px solid #000}
.pick label{margin-right:1em;cursor:pointer}.legend span{display:none}"""


def render_page(records: Sequence[dict], *, title: str) -> str:
    """One self-contained HTML page of ``records`` (module docstring)."""
    names = field_names(records)
    scales = {n: field_scale(records, n) for n in names}
    rules, buttons, legend = [], [], []
    for i, n in enumerate(names):
        lo, hi = scales[n]
        rules.append(f"#q{i}:checked~.maps .t:not(.obs){{background:var(--c{i})}}"
                     f"#q{i}:checked~.legend .l{i}{{display:inline}}")
        buttons.append(f'<input type="radio" name="q" id="q{i}"{" checked" if i == 0 else ""}>'
                       f'<label for="q{i}">{html.escape(n)}</label>')
        kind = "red > 0 > blue" if lo < 0 else "white at the smallest, purple at the largest"
        legend.append(f'<span class="l{i}">{html.escape(n)}: {_num(lo)} .. {_num(hi)} ({kind})</span>')
    body = "".join(_response(rec, names, scales) for rec in records)
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{_CSS}\n{"".join(rules)}</style></head><body><h2>{html.escape(title)}</h2>'
            f'<div class="pick">colour by: </div>{"".join(buttons)}'
            f'<p class="legend">{"".join(legend)}</p><div class="maps">{body}</div>'
            "<p><small>Hover a token for its numbers. Grey dashed tokens are not scored by the loss "
            "(observations).</small></p></body></html>\n")


def _wrap_lines(tokens: Sequence[str], width_in: float, cw: float) -> tuple[list, int]:
    """(x, line, width, shown text, index) of each token wrapped at ``width_in`` inches; the line count."""
    x, line, placed = 0.0, 0, []
    for t, text in enumerate(tokens):
        shown = text.replace("\n", "\u21b5") or "\u2205"
        w = cw * len(shown) + 0.06
        if x + w > width_in - 0.4 and x > 0:
            x, line = 0.0, line + 1
        placed.append((x, line, w, shown, t))
        x += w + 0.03
    return placed, line + 1


def render_png(recs: Sequence[dict], name: str, path: str, *, scale_from: Sequence[dict] = (),
               width_in: float = 9.0) -> None:
    """Responses ``recs`` (one for a paper's figure, or a whole map), one block each (why chosen, prompt,
    reward, verdict, then the tokens coloured by quantity ``name``), as a PNG at ``path`` (matplotlib). The
    colour scale spans ``scale_from`` (default: ``recs``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for rec in recs:
        if name not in rec["fields"]:
            raise ValueError(f"--field {name!r}: this response has {list(rec['fields'])}")
    lo, hi = field_scale(list(scale_from) or list(recs), name)
    fs, cw, lh = 11.0, 11.0 * 0.62 / 72, 11.0 * 2.0 / 72  # font size (pt), a character's width and a line (in)
    blocks = [_wrap_lines(rec["tokens"], width_in, cw) for rec in recs]
    head, sub = 0.55, 0.32  # the title; each response's own heading line (inches)
    height = head + sum(sub + n * lh + 0.12 for _, n in blocks) + 0.1
    fig = plt.figure(figsize=(width_in, height))
    kind = "red > 0 > blue" if lo < 0 else "white = smallest, purple = largest"
    fig.text(0.2 / width_in, 1 - 0.2 / height, f"{recs[0]['algorithm']}, iteration {recs[0]['iteration']}: {name}  "
             f"({_num(lo)} .. {_num(hi)}, {kind})", fontsize=fs + 1, weight="bold", va="top")
    top = height - head
    for rec, (placed, lines) in zip(recs, blocks):
        verdict = "correct" if rec["correct"] else "incorrect"
        prompt = rec["prompt"].replace("\n", " ")[-60:]
        fig.text(0.2 / width_in, (top - 0.05) / height, f"{rec['chosen']}: {prompt}  reward {rec['reward']:+.3g}, "
                 f"{verdict}", fontsize=fs - 2, va="top", family="monospace", color="#333")
        top -= sub
        for x, line, w, shown, t in placed:
            obs = rec["observation"][t]
            rgb = (230, 230, 230) if obs else colour(rec["fields"][name][t], lo, hi)
            y = top - (line + 1) * lh + 0.1
            fig.patches.append(matplotlib.patches.FancyBboxPatch(
                ((0.2 + x) / width_in, y / height), w / width_in, (lh * 0.75) / height,
                boxstyle="round,pad=0,rounding_size=0.004", transform=fig.transFigure,
                facecolor=tuple(c / 255 for c in rgb), edgecolor="#999" if obs else "#ddd",
                linestyle="--" if obs else "-", linewidth=0.6))
            fig.text((0.2 + x + 0.03) / width_in, (y + lh * 0.37) / height, shown, fontsize=fs,
                     family="monospace", va="center", color="#555" if obs else "#111")
        top -= lines * lh + 0.12
    fig.savefig(path, dpi=150)
    plt.close(fig)
