"""Credit maps: which responses of an iteration are shown, their per-token records (``writer``), and the
page and picture rendered from them (``page``); docs/credit_maps.md. Read by the trainer (a map every
``logging.credit_map_every`` iterations) and by ``tools/credit_map.py``; they import no trainer code."""
