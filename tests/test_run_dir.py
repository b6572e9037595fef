"""``megatron_credit.run_dir`` (where a run keeps its checkpoints) and its old path ``run_layout``, kept for
one release for launch scripts copied from ``examples/launch/``."""
from __future__ import annotations

import importlib
import sys

import pytest

from megatron_credit import run_dir


def test_the_old_module_path_warns_and_reexports_run_dir(tmp_path):
    sys.modules.pop("megatron_credit.run_layout", None)
    with pytest.warns(DeprecationWarning, match=r"^megatron_credit\.run_layout is now megatron_credit\.run_dir;"):
        old = importlib.import_module("megatron_credit.run_layout")
    assert old.complete_checkpoints is run_dir.complete_checkpoints
    assert old.checkpoint_dir is run_dir.checkpoint_dir
    assert (old.MODEL_OPTIM, old.CRITIC_OPTIM) == ("model_optim", "critic_optim")
    done = tmp_path / "checkpoints" / "iter_0000012"
    done.mkdir(parents=True)
    (done / "meta.json").write_text("{}")
    (tmp_path / "checkpoints" / "iter_0000013").mkdir()  # no meta.json: a save cut short
    assert old.complete_checkpoints(str(tmp_path)) == [(12, str(done))]
    assert old.checkpoint_dir("runs/demo", 12) == "runs/demo/checkpoints/iter_0000012"
