"""Conversion parity with every weight distinct: a rule that maps the wrong HF tensor of
the same shape (``q_norm`` <-> ``k_norm``, ``input_layernorm`` <-> ``post_attention_layernorm``, k/v
biases, gate/up biases) or the wrong TP split of a bias (fc1's ``[gate_r; up_r]`` per rank) changes
the logits here.

HF's initialisation makes norms all ones and biases all zeros, and the scaled parity runs multiply
``q_norm`` and ``k_norm`` by the same factor, so a swap of two such tensors cannot move the logits of
``tests/conversion/test_parity.py``. Here every HF tensor is drawn afresh (norms ``1 + noise``,
biases ``noise``, q/k made peaked so that RoPE and per-head scales matter), a guard asserts that no
two tensors are equal up to scale, and the megatron model at TP=2 and PP=2 must give the logits of
``transformers``.

Llama with ``attention_bias`` and ``mlp_bias`` biases every linear layer, which is megatron's
``add_bias_linear``; ``models/hf_config.py`` refuses the flags for actors (one of them alone is not a
megatron model), so the test builds that megatron model with the two bias flags passed as overrides.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.parity import LENGTHS, TOL, _batch, _last, _rel_err

CASES = {
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", {}),  # per-head q/k norms
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),  # biases on every linear
}
LAYOUTS = [(2, 1), (1, 2)]  # TP=2 shards every rule that has a TP split; PP=2 offsets the layers


def _config(case: str):
    from megatron_credit.conversion.testing import tiny_hf_config

    family, extra = CASES[case]
    return tiny_hf_config(family, vocab_size=160, **extra)


def _fill_unique(model, seed: int = 0) -> None:
    """Every tensor redrawn: norms ``1 + 0.3 N(0, 1)``, biases ``0.1 N(0, 1)``, weights ``0.02 N(0, 1)``;
    q/k projections x12 (q/k norms x3 for Qwen3, whose per-head norms undo a projection scale) so that
    attention is peaked and per-dimension q/k scales reach the logits through RoPE."""
    gen = torch.Generator().manual_seed(seed)
    qwen3 = model.config.model_type == "qwen3"
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.3 * noise
                if qwen3 and name.endswith(("q_norm.weight", "k_norm.weight")):
                    value = 3.0 * value
            elif name.endswith(".bias"):
                value = 0.1 * noise
            else:
                value = 0.02 * noise
                if not qwen3 and name.endswith(("q_proj.weight", "k_proj.weight")):
                    value = 12.0 * value
            p.copy_(value)


def _assert_all_distinct(state: dict[str, torch.Tensor]) -> None:
    """No tensor is constant and no two tensors of one shape are equal up to a positive scale."""
    for name, t in state.items():
        assert t.numel() < 2 or t.std() > 0, f"{name} is constant"
    by_shape: dict[tuple, list[str]] = {}
    for name, t in state.items():
        by_shape.setdefault(tuple(t.shape), []).append(name)
    for names in by_shape.values():
        for a, b in itertools.combinations(names, 2):
            x, y = state[a].flatten(), state[b].flatten()
            assert not torch.allclose(x / x.norm(), y / y.norm(), atol=1e-6), f"{a} and {b} are equal up to scale"


def _make_hf_dir(root: Path, case: str) -> Path:
    from transformers import AutoModelForCausalLM

    out = root / case
    model = AutoModelForCausalLM.from_config(_config(case), dtype=torch.float32)
    _fill_unique(model)
    _assert_all_distinct(model.state_dict())
    model.save_pretrained(out)
    return out


def _hf_logits(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    ids, mask, pos = _batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


# --- worker side -----------------------------------------------------------------------------------
def _megatron_logits(hf_dir: str, tp: int, pp: int):
    """Logits [B, S, V] of the model loaded by ``load_hf_into_local_state`` (None off the last stage)."""
    import copy

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.conversion import family_for_config, load_hf_into_local_state
    from megatron_credit.conversion.model_io import load_hf_config
    from megatron_credit.conversion.hf_io import SafetensorsReader
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    distributed.initialize(parallel, seed=0)
    try:
        cfg = load_hf_config(hf_dir)
        arch_cfg, overrides = cfg, {}
        if getattr(cfg, "mlp_bias", False) and getattr(cfg, "attention_bias", False):
            arch_cfg = copy.deepcopy(cfg)  # every linear biased: megatron's add_bias_linear
            arch_cfg.attention_bias = arch_cfg.mlp_bias = False
            overrides = dict(add_bias_linear=True, add_qkv_bias=True)
        tcfg = transformer_config_from_hf(arch_cfg, parallel=parallel, params_dtype=torch.float32,
                                          perform_initialization=False, **overrides)
        model = build_gpt_model(arch_cfg, tcfg, use_transformer_engine=False)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        load_hf_into_local_state(model.state_dict(keep_vars=True), SafetensorsReader(hf_dir).get,
                                 family_for_config(cfg), cfg, tp_rank=tp_rank, tp_size=tp,
                                 layer_offset=pp_rank * cfg.num_hidden_layers // pp)
        model.eval()
        ids, mask, pos = _batch()
        s = ids.shape[1]
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
        allowed = causal & (mask.bool()[:, None, :] | torch.eye(s, dtype=torch.bool))
        with torch.no_grad():
            pp_group = ps.get_pipeline_model_parallel_group()
            ranks = dist.get_process_group_ranks(pp_group)
            if pp_rank > 0:
                hidden = torch.empty(s, len(LENGTHS), cfg.hidden_size)
                dist.recv(hidden, src=ranks[pp_rank - 1], group=pp_group)
                model.set_input_tensor(hidden)
            out = model(ids, pos, ~allowed[:, None])
            if pp_rank < pp - 1:
                dist.send(out.contiguous(), dst=ranks[pp_rank + 1], group=pp_group)
                return None
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            return torch.cat(parts, dim=-1)
    finally:
        distributed.destroy()


# --- tests -----------------------------------------------------------------------------------------
pool = module_pool(2)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_unique")
    return {case: _make_hf_dir(root, case) for case in CASES}


def test_distinctness_guard_rejects_equal_norms():
    """The guard itself: HF's default init (ones, zeros) and a common scale of q/k norms are refused."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config("qwen3"), dtype=torch.float32)
    with pytest.raises(AssertionError, match="constant|equal up to scale"):
        _assert_all_distinct(model.state_dict())
    _fill_unique(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_all_distinct(state)
    state["model.layers.0.self_attn.k_norm.weight"] = 3.0 * state["model.layers.0.self_attn.q_norm.weight"]
    with pytest.raises(AssertionError, match="equal up to scale"):
        _assert_all_distinct(state)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.dist
def test_logits_match_transformers_with_distinct_weights(pool, hf_dirs, case):
    want = _hf_logits(hf_dirs[case])
    for tp, pp in LAYOUTS:
        got = _last(pool.run(_megatron_logits, str(hf_dirs[case]), tp, pp))
        assert got.shape == want.shape
        err = _rel_err(got, want)
        assert err < TOL, (case, tp, pp, err)
