"""megatron-core compatibility (supported range >=0.16.1,<0.20): the CPU shims' targets exist with the
signatures they patch, our seeds equal megatron's, and the version-dependent wrappers work.

These pass on the installed megatron-core (CI: 0.16.1); they are what fails, with a message naming
the moved target, when an upgrade moves something a shim relies on.
"""
from __future__ import annotations

import pytest
import torch

from megatron_credit import distributed
from megatron_credit.distributed import cpu_shims
from tests.support.distributed_harness import module_pool


def test_shim_targets_exist_on_the_installed_megatron_core():
    assert cpu_shims.cpu_shim_problems() == []


def test_a_moved_shim_target_fails_loudly_instead_of_silently_not_patching(monkeypatch):
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.tensor_parallel.random as mrandom

    monkeypatch.delattr(rotary, "get_pos_emb_on_this_cp_rank")
    monkeypatch.delattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED")
    problems = cpu_shims.cpu_shim_problems()
    assert any("rotary_pos_embedding.get_pos_emb_on_this_cp_rank is missing" in p for p in problems)
    assert any("random._CUDA_RNG_STATE_TRACKER_INITIALIZED is missing" in p for p in problems)
    monkeypatch.setattr(cpu_shims, "_SHIMS_INSTALLED", False)
    with pytest.raises(RuntimeError, match="CPU shims in megatron_credit/distributed/cpu_shims.py need updating"):
        cpu_shims.install_cpu_shims()  # raises before patching anything


def test_changed_rope_helper_signature_is_reported(monkeypatch):
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    monkeypatch.setattr(rope_utils, "get_pos_emb_on_this_cp_rank",
                        lambda pos_emb, seq_dim, cp_group, extra: pos_emb)
    assert any("rope_utils.get_pos_emb_on_this_cp_rank" in p and "is not" in p
               for p in cpu_shims.cpu_shim_problems())


class _RecordingTracker:
    """Stands in for megatron's CudaRNGStatesTracker: records the streams it is asked to add."""

    def __init__(self):
        self.seeds = {}

    def reset(self):
        self.seeds = {}

    def add(self, name, seed):
        self.seeds[name] = seed


@pytest.mark.parametrize("tp_rank", [0, 1, 3])
def test_cpu_rng_streams_have_megatrons_seeds(monkeypatch, tp_rank):
    """The CPU tracker's streams are exactly those model_parallel_cuda_manual_seed adds (no EP;
    expert-TP rank = TP rank), so CPU and GPU runs draw dropout from the same seeds."""
    import megatron.core.tensor_parallel.random as mrandom

    recorder = _RecordingTracker()
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", recorder)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: None)
    mrandom.model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, ep_rank=0, etp_rank=tp_rank)
    assert recorder.seeds == distributed.cpu_rng_stream_seeds(1234, tp_rank=tp_rank)
    assert recorder.seeds[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] == 1234 + 2718 + tp_rank


pool = module_pool(2)


def _cp_split_worker(batch):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    return distributed.get_batch_on_this_cp_rank(dict(batch), cp_group=group)


@pytest.mark.dist
def test_get_batch_on_this_cp_rank_wrapper_keeps_chunks_r_and_2cp_minus_1_minus_r(pool):
    gen = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, 100, (2, 8), generator=gen),
             "attention_mask": torch.rand(2, 1, 8, 8, generator=gen)}
    out = pool.run(_cp_split_worker, batch)
    for rank, local in enumerate(out):
        keep = [2 * rank, 2 * rank + 1, 6 - 2 * rank, 7 - 2 * rank]  # chunks r, 3 - r of 4 (c = 2)
        assert torch.equal(local["tokens"], batch["tokens"][:, keep])
        assert torch.equal(local["attention_mask"], batch["attention_mask"][:, :, keep])


def test_moved_language_module_or_saver_targets_are_reported(monkeypatch):
    import megatron.core.dist_checkpointing.strategies.state_dict_saver as saver
    from megatron.core.models.common.language_module.language_module import LanguageModule

    assert "megatron.core.dist_checkpointing.strategies.state_dict_saver" in cpu_shims._SHIMMED_MODULES
    monkeypatch.delattr(LanguageModule, "_is_in_embd_group")
    monkeypatch.delattr(saver, "torch")
    problems = cpu_shims.cpu_shim_problems()
    assert any("LanguageModule._is_in_embd_group is missing (shim 4)" in p for p in problems)
    assert any("state_dict_saver has no module-level `torch`" in p for p in problems)
