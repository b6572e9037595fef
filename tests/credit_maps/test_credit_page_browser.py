"""The credit page (``credit_maps/page.py``) in a real browser: headless Chromium over the DevTools
protocol (``tests/support/browser.py``). The selector, CSS alone, recolours every token with the numbers of
the chosen quantity; the page sends no request; a response that writes ``<script>``, ``<img onerror>`` or
``<svg onload>`` runs nothing. Each check has a positive control: a page that does load something, and the
same page rendered without escaping, are caught by the same detection.

Skipped where no Chromium is found (``make browser`` installs Debian's). ``python -m
tests.credit_maps.test_credit_page_browser docs/results/credit_page_browser.png`` saves the screenshot that the
first test takes (``docs/credit_maps.md``).
"""
from __future__ import annotations

import struct
import sys
import types

import pytest
import torch

from tests.support.browser import Browser, find_chromium

pytestmark = pytest.mark.spawn

# Each payload records that it ran in a global and on the console; no quotes and no spaces, so that even
# unescaped inside the page's quoted title="..." attribute it cannot end the attribute early.
RAN = "(window.ran=window.ran||[]).push(/{0}/.source),console.log(/ran/.source)"
PAYLOADS = {77: f"<script>{RAN.format('script')}</script>", 78: f"<img src=x onerror={RAN.format('img')}>",
            79: f"<svg onload={RAN.format('svg')}>"}
ALGORITHM = PAYLOADS[79]  # in the page's title and heading
OBS = "rgb(230, 230, 230)"  # an observation's grey (#e6e6e6), whatever the quantity


class _Tok:
    """Decodes id i to "t<i>", and the ids of :data:`PAYLOADS` to markup (a response may write anything)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PAYLOADS.get(i, f"t{i}") for i in ids)


def _write_map(run_dir) -> str:
    """The map of a fixed batch as the trainer writes it (``CreditMaps.write``); the page's path. Each
    response starts with the three payloads and ends with the first; its prompt starts with the image's;
    a response of five or more tokens has an observation at its third token. ``advantage`` diverges around
    0 (red/blue), ``f_t`` is never negative (white to purple)."""
    from megatron_credit.credit_maps.writer import CreditMaps
    from tests.support.fixed_batch import _global_batch

    batch = _global_batch()
    for row in range(batch.labels.shape[0]):
        pos = batch.loss_mask[row].nonzero().flatten().tolist()
        for p, tok in zip((pos[0], pos[1], pos[-1]), (77, 78, 79)):
            batch.labels[row, p] = tok
        if len(pos) >= 5:
            batch.loss_mask[row, pos[2]] = False
        batch.input_ids[row, 0] = 78
    g = torch.Generator().manual_seed(3)
    mask = batch.loss_mask
    fields = {"advantage": torch.where(mask, torch.randn(mask.shape, generator=g), 0.0),
              "f_t": torch.where(mask, 1 + 0.2 * torch.rand(mask.shape, generator=g), 1.0)}
    return CreditMaps(str(run_dir), every=1, samples=4, tokenizer=_Tok(), algorithm=ALGORITHM).write(1, batch, fields)


def _expected_colours(page: str, name: str) -> list[str]:
    """The background of each token of ``page``'s map coloured by quantity ``name``, from its records."""
    from megatron_credit.credit_maps.writer import read_records
    from megatron_credit.credit_maps.page import colour, field_scale

    records = read_records(page[: -len("html")] + "jsonl")
    scale = field_scale(records, name)
    return [OBS if r["observation"][t] else f"rgb{colour(r['fields'][name][t], *scale)}"
            for r in records for t in range(len(r["tokens"]))]


COLOURS = "[...document.querySelectorAll('.maps .t')].map(e => getComputedStyle(e).backgroundColor)"
LEGEND = "[...document.querySelectorAll('.legend span')].filter(e => e.offsetParent).map(e => e.textContent)"


@pytest.fixture(scope="module")
def browser():
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium on the PATH (make browser installs Debian's chromium)")
    with Browser(path) as b:
        yield b


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


def _switch_and_shoot(browser, run_dir) -> tuple[list, list, bytes, bytes]:
    """The token colours and a screenshot before and after a click on the selector's second quantity."""
    page = browser.open(f"file://{_write_map(run_dir)}")
    try:
        before, shot_before = page.evaluate(COLOURS), page.screenshot()
        assert page.evaluate(LEGEND)[0].startswith("advantage: ")
        page.click("label[for=q1]")
        assert page.evaluate("document.getElementById('q1').checked") is True
        assert page.evaluate(LEGEND)[0].startswith("f_t: ")
        return before, page.evaluate(COLOURS), shot_before, page.screenshot()
    finally:
        page.close()


def test_switching_the_selector_recolours_every_token_with_the_chosen_quantity(browser, tmp_path):
    before, after, shot_before, shot_after = _switch_and_shoot(browser, tmp_path)
    page = str(tmp_path / "credit_maps" / "iter_0000001.html")
    assert before == _expected_colours(page, "advantage")  # the first quantity is checked on load
    assert after == _expected_colours(page, "f_t")
    assert OBS in before and sum(c == OBS for c in before) == sum(c == OBS for c in after) >= 1
    changed = sum(b != a for b, a in zip(before, after))
    assert changed == sum(c != OBS for c in before)  # every scored token changed colour, no grey one did
    rgb = [[int(x) for x in c[4:-1].split(",")] for c in before + after]
    red = [r > b for r, g, b in rgb]  # the diverging scale's red half; the purple ramp has b > r
    assert any(red[: len(before)]) and not any(red[len(before):])
    assert _png_size(shot_before) == _png_size(shot_after) == (900, 700) and shot_before != shot_after


def test_the_page_sends_no_request_and_one_that_loads_something_is_caught(browser, tmp_path):
    path = _write_map(tmp_path)
    page = browser.open(f"file://{path}")
    assert page.requests() == [page.url]  # its own document, nothing else
    page.close()
    # the positive control: the same page with a style sheet, an image and a font to load
    text = open(path, encoding="utf-8").read().replace("<body>", '<body><link rel="stylesheet" href='
        '"http://credit-map.invalid/a.css"><img src="https://203.0.113.9/b.png">'
        "<style>@font-face{font-family:f;src:url(http://credit-map.invalid/c.woff)}body{font-family:f}</style>", 1)
    loads = tmp_path / "loads.html"
    loads.write_text(text, encoding="utf-8")
    page = browser.open(f"file://{loads}")
    wanted = ["http://credit-map.invalid/a.css", "https://203.0.113.9/b.png", "http://credit-map.invalid/c.woff"]
    assert page.requests()[0] == page.url and sorted(page.requests()[1:]) == sorted(wanted)
    assert set(page.failures()) == set(wanted)  # and the blocked network let none of them through
    page.close()


def test_hostile_response_text_runs_nothing_and_unescaped_it_would_be_caught(browser, tmp_path, monkeypatch):
    from megatron_credit.credit_maps import page as credit_page
    from megatron_credit.credit_maps.writer import read_records

    path = _write_map(tmp_path)
    records = read_records(path[: -len("html")] + "jsonl")
    page = browser.open(f"file://{path}")
    assert page.evaluate("typeof window.ran") == "undefined" and page.console() == []
    assert page.evaluate("document.querySelectorAll('script, img, svg, [onerror], [onload]').length") == 0
    title = f"{ALGORITHM}: credit map of iteration 1"
    assert page.evaluate("document.title") == page.evaluate("document.querySelector('h2').textContent") == title
    shown = page.evaluate("[...document.querySelectorAll('.maps .t')].map(e => e.textContent)")
    assert shown == [t for r in records for t in r["tokens"]] and PAYLOADS[77] in shown  # shown as text
    assert page.evaluate("[...document.querySelectorAll('pre.prompt')].map(e => e.textContent)") == [
        r["prompt"] for r in records]
    assert page.requests() == [page.url]
    page.close()
    # the positive control: the same records rendered with escaping switched off run all three payloads
    monkeypatch.setattr(credit_page, "html", types.SimpleNamespace(escape=lambda s, quote=True: s))
    raw = tmp_path / "unescaped.html"
    raw.write_text(credit_page.render_page(records, title=title), encoding="utf-8")
    page = browser.open(f"file://{raw}")
    assert set(page.evaluate("window.ran")) == {"script", "img", "svg"}
    assert page.console() and set(page.console()) == {"console.log: ran"}
    page.close()


def main(argv: list[str]) -> int:
    """Save the screenshot that the first test takes after switching to ``f_t`` at ``argv[0]``."""
    import tempfile

    path = find_chromium()
    if path is None:
        raise SystemExit("no Chromium on the PATH (make browser installs Debian's chromium)")
    with Browser(path) as browser, tempfile.TemporaryDirectory() as run_dir:
        shot = _switch_and_shoot(browser, run_dir)[3]
    with open(argv[0], "wb") as f:
        f.write(shot)
    print(f"{argv[0]}: {len(shot)} bytes, {_png_size(shot)[0]} x {_png_size(shot)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
