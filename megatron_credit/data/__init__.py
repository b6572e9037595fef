"""Data: prompt datasets, the synthetic arithmetic task and its tokenizer (what becomes a prompt; the batch
the samples become is :mod:`megatron_credit.batch`).

| module | what lives there |
| --- | --- |
| ``records.py`` | ``ChatMessage``, ``PromptRecord`` |
| ``dataset.py`` | DAPO-schema parquet / jsonl: validation, de-duplication, chat template, length filter |
| ``synthetic.py`` | ``ArithmeticTask``: arithmetic answered as ``Answer: N``, deterministic by index |
| ``tool_task.py`` | ``ToolTask``: multiplication whose answer the model may get from the calculator (the multi-turn demo) |
| ``tokenizer.py`` | the sentencepiece BPE tokenizer of the synthetic task, trained at first use and cached |
| ``prompts.py``, ``chain.py`` | the prompt stream (resumable cursor), chained sources |
| ``source_base.py`` | what a source derives from and builds (``PromptSource``, ``PromptData``), the ``PROMPT_SOURCES`` registry, the HF tokenizer of a ``data`` section |
| ``sources.py`` | the built-in ``data.source`` sources (``PROMPT_SOURCES`` re-exported for plug-ins) |
| ``reasoning_gym_tasks.py`` | ``reasoning_gym``: reasoning-gym's procedural tasks (an optional dependency) |

Importing this package imports nothing (pyarrow and sentencepiece load in the functions that use them).
"""
