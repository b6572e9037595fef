"""Render a run's credit map (``docs/credit_maps.md``): the page of an iteration from its
``credit_maps/iter_<N>.jsonl``, and a PNG of one of its responses coloured by one quantity (for papers).

    python tools/credit_map.py --run DIR [--iter N] [--field advantage] [--sample 0|all] [--out PAGE.html]

``--iter``: the newest map when left out. The page goes to ``--out`` (default: the run's own
``credit_maps/iter_<N>.html``, rendered again), the PNG next to it (``--png`` to choose;
``<page>_sample<k>_<field>.png`` by default, ``<out>.png`` with ``--out``). Needs matplotlib for the PNG.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
from typing import Optional, Sequence


def _iterations(run: str) -> list[int]:
    found = (re.fullmatch(r"iter_(\d+)\.jsonl", os.path.basename(p))
             for p in glob.glob(os.path.join(run, "credit_maps", "iter_*.jsonl")))
    return sorted(int(m.group(1)) for m in found if m)


def build_parser() -> argparse.ArgumentParser:
    """The options (``main`` parses with it; the tests walk its actions)."""
    from megatron_credit.cli import positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the run directory (its credit_maps/)")
    p.add_argument("--iter", type=positive_int, default=None,
                   help="the iteration (default: the newest map)")
    p.add_argument("--field", default="advantage", help="the quantity that colours the PNG")
    p.add_argument("--sample", default="0", help="which response of the map goes into the PNG (its index, or 'all')")
    p.add_argument("--out", default=None, help="the page (default: the run's credit_maps/iter_<N>.html)")
    p.add_argument("--png", default=None, help="the PNG (default: next to the page)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    from megatron_credit.credit_maps.writer import map_path, read_records, write_page
    from megatron_credit.credit_maps.page import field_names, render_png

    have = _iterations(a.run)
    if not have:
        raise SystemExit(f"error: --run {a.run}: no credit_maps/iter_*.jsonl (logging.credit_map_every)")
    it = have[-1] if a.iter is None else a.iter
    if it not in have:
        raise SystemExit(f"error: --iter {it}: no credit map of iteration {it} in {a.run} (maps: {have})")
    records = read_records(map_path(a.run, it, "jsonl"))
    if a.sample != "all" and not (a.sample.isdigit() and int(a.sample) < len(records)):
        raise SystemExit(f"error: --sample {a.sample}: the map of iteration {it} has {len(records)} responses "
                         "(0-based, or 'all')")
    names = field_names(records)
    if a.field not in names:
        raise SystemExit(f"error: --field {a.field!r}: the map of iteration {it} has {names}")
    page = a.out or map_path(a.run, it, "html")
    write_page(records, page, title=f"{records[0]['algorithm']}: credit map of iteration {it}")
    png = a.png or (os.path.splitext(page)[0] + (".png" if a.out else f"_sample{a.sample}_{a.field}.png"))
    render_png(records if a.sample == "all" else [records[int(a.sample)]], a.field, png, scale_from=records)
    print(f"page: {page}\npng: {png}")
    return 0
