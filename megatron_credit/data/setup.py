"""The data a run trains and validates on: the tokenizer, the training prompt stream, the validation
prompts and the synthetic task, from the recipe's ``data`` section (``trainer.loop.build`` calls
:func:`build_data` once per launch).
"""
from __future__ import annotations

import dataclasses


def hf_tokenizer(path: str, *, field: str):
    """``AutoTokenizer.from_pretrained(path)`` (a folder or a hub name); one that transformers cannot load
    a tokenizer from is a ``ValueError`` naming the recipe field and the path, not a traceback."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{field}: no tokenizer could be loaded from {path!r} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc


def build_data(d, *, seed: int, model_path: str | None, val_every: int, val_prompts: int, log=lambda *_: None):
    """(tokenizer, train prompt stream, validation prompts or None, the synthetic task or None) of the
    recipe's ``data`` section ``d``; ``seed``: the run's; ``model_path`` (``model.name_or_path``): where the
    tokenizer comes from when ``data.tokenizer_path`` is unset; ``val_every`` / ``val_prompts``
    (``train.*``): validation prompts are built when ``val_every`` is set.

    The stream and the validation prompts are the job's, the same on every rank: each iteration takes
    ``rollout.prompts_per_step`` prompts, which the engines split (``rollout.placement``), so what is
    sampled does not depend on the number of ranks or engines, and the cursor resumes on any layout."""
    from megatron_credit.data.prompts import DatasetPrompts, SyntheticPrompts

    if d.source == "synthetic_arith":
        from megatron_credit.data.synthetic import ArithConfig, ArithmeticTask
        from megatron_credit.data.tokenizer import ArithTokenizerConfig, load_arith_tokenizer

        arith = ArithConfig(seed=seed, num_operands=d.num_operands, min_operand=d.min_operand,
                            max_operand=d.max_operand)
        tokenizer = load_arith_tokenizer(ArithTokenizerConfig(vocab_size=d.tokenizer_vocab_size, task=arith))
        task = ArithmeticTask(arith)
        val = None
        if val_every:
            val = SyntheticPrompts(ArithmeticTask(dataclasses.replace(arith, seed=seed + 1)), tokenizer).take(val_prompts)
        return tokenizer, SyntheticPrompts(task, tokenizer), val, task
    if d.source == "synthetic_chain":
        return _chain_data(d, seed=seed, val_every=val_every, val_prompts=val_prompts)
    if d.source == "synthetic_tool":
        return _tool_data(d, seed=seed, val_every=val_every, val_prompts=val_prompts)
    from megatron_credit.data.dataset import load_prompt_dataset

    tokenizer = hf_tokenizer(d.tokenizer_path or model_path,
                             field="data.tokenizer_path" if d.tokenizer_path else "model.name_or_path")
    train_ds = load_prompt_dataset([d.train_path], tokenizer=tokenizer, max_prompt_len=d.max_prompt_len)
    val = None
    if d.val_path and val_every:
        val_ds = load_prompt_dataset([d.val_path], tokenizer=tokenizer, max_prompt_len=d.max_prompt_len)
        val = DatasetPrompts(val_ds.records, tokenizer, seed=seed).take(min(val_prompts, len(val_ds.records)))
    stream = DatasetPrompts(train_ds.records, tokenizer, seed=seed)
    stream.dropped_prompts = train_ds.stats.too_long  # data/dropped_prompts, a warning over 10%
    warning = train_ds.stats.too_long_warning(f"data.train_path {d.train_path}")
    if warning:
        log(warning)
    return tokenizer, stream, val, None


def _chain_data(d, *, seed: int, val_every: int, val_prompts: int):
    """``build_data`` of the chain task (``data/chain.py``): its tokenizer is the arithmetic one trained
    on additions of the same operands (the same characters), independent of the seed."""
    from megatron_credit.data.chain import ChainConfig, ChainTask
    from megatron_credit.data.prompts import SyntheticPrompts
    from megatron_credit.data.synthetic import ArithConfig
    from megatron_credit.data.tokenizer import ArithTokenizerConfig, load_arith_tokenizer

    chain = ChainConfig(seed=seed, num_operands=d.num_operands, min_operand=d.min_operand,
                        max_operand=d.max_operand, decisive=d.decisive)
    text = ArithConfig(num_operands=d.num_operands, min_operand=d.min_operand, max_operand=d.max_operand)
    tokenizer = load_arith_tokenizer(ArithTokenizerConfig(vocab_size=d.tokenizer_vocab_size, task=text))
    val = None
    if val_every:
        val_task = ChainTask(dataclasses.replace(chain, seed=seed + 1))
        val = SyntheticPrompts(val_task, tokenizer).take(val_prompts)
    task = ChainTask(chain)
    return tokenizer, SyntheticPrompts(task, tokenizer), val, task


def _tool_data(d, *, seed: int, val_every: int, val_prompts: int):
    """``build_data`` of the calculator task (``data/tool_task.py``): multiplications of the recipe's
    operands; the tokenizer has the tool markers as single pieces and a generation prompt without
    ``Answer:``, and is trained on the task's text independent of the seed."""
    from megatron_credit.data.prompts import SyntheticPrompts
    from megatron_credit.data.synthetic import ArithConfig
    from megatron_credit.data.tokenizer import ArithTokenizerConfig, load_arith_tokenizer
    from megatron_credit.data.tool_task import TOOL_MARKERS, ToolTask

    text = ArithConfig(num_operands=d.num_operands, min_operand=d.min_operand, max_operand=d.max_operand,
                       ops=("*",))
    tokenizer = load_arith_tokenizer(ArithTokenizerConfig(vocab_size=d.tokenizer_vocab_size, task=text,
                                                          extra_symbols=TOOL_MARKERS, answer_prefix=False))
    val = None
    if val_every:
        val = SyntheticPrompts(ToolTask(dataclasses.replace(text, seed=seed + 1)), tokenizer).take(val_prompts)
    task = ToolTask(dataclasses.replace(text, seed=seed))
    return tokenizer, SyntheticPrompts(task, tokenizer), val, task
