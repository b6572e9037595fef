"""Data: prompt datasets, the synthetic arithmetic task and its tokenizer, token-budget micro-batching.

| module | what lives there |
| --- | --- |
| ``records.py`` | ``ChatMessage``, ``PromptRecord`` |
| ``dataset.py`` | DAPO-schema parquet / jsonl: validation, de-duplication, chat template, length filter |
| ``synthetic.py`` | ``ArithmeticTask``: arithmetic answered as ``Answer: N``, deterministic by index |
| ``tokenizer.py`` | the sentencepiece BPE tokenizer of the synthetic task, trained at first use and cached |
| ``microbatch.py`` | token-budget micro-batches, shared by the old-log-prob pass and the update |
| ``context_parallel.py`` | splitting sequences for context parallelism |

Importing this package imports nothing (pyarrow and sentencepiece load in the functions that use them).
"""
