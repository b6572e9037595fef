"""Shared pytest set-up: GPU-marked tests are skipped with a reason on machines without CUDA."""
import os

import pytest
import torch

# Spawned gloo workers and the main process share 2 cores in CI: one intra-op thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: this machine has no GPU (run on a GPU node)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
