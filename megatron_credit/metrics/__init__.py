"""Metrics: where every trained statistic is declared, reduced and named, and where the numbers are written.

| file | owns |
|---|---|
| ``tables.py`` | ``MetricTable``: how each loss statistic is reduced and which metric names come out of the reduced values; the trainer's own table (``CORE``) and the built-in algorithms' |
| ``sums.py`` | ``StatSums`` (``sum:`` / ``min:`` / ``max:`` tensors across micro-batches), ``loss_statistics`` (a loss's statistics as the tables declare them), ``Reduction`` (over DP x CP, across the pipeline, then named) |
| ``writer.py`` | ``metrics.jsonl``, TensorBoard and wandb |

A statistic is computed where its math is (a loss's in ``losses/``, the credit diagnostics in
``credit/diagnostics.py``) and handed over as ``sum:`` / ``min:`` / ``max:`` values. Rollout-side metrics
(``rollout/``, ``reward/``, ``time/``) are whole numbers made where the samples are; the trainer writes them
next to these (``docs/training.md``, "Reading a run").
"""
