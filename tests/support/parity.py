"""The HF <-> megatron logit-parity helpers of ``tests/conversion/`` (tiny HF models of each family,
megatron logits at a TP / PP layout, the relative error), shared by test_parity, test_unique_weights and
test_tp_exceeds_kv_heads. The megatron side runs inside a ``DistributedPool`` worker."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.support.distributed_harness import pipeline_forward


from megatron_credit.families import FAMILIES as _FAMILIES, supported_model_types

TOL = 1e-4  # max |megatron - hf| / max |hf| over valid positions, fp32
TIED = ["llama-tied", "qwen3-tied"]  # always built with peaked attention
LENGTHS = [12, 7, 4]  # left-padded batch of 3 sequences, 12 positions


def _config(family: str):
    """Tiny config; vocab 160 splits over TP=2. ``*-tied`` ties embeddings as Llama 3.2 / Qwen3 do."""
    from megatron_credit.conversion.testing import tiny_hf_config

    return tiny_hf_config(family.removesuffix("-tied"), vocab_size=160, tie_word_embeddings=family.endswith("-tied"))


# Every registered dense family (the MoE ones: tests/conversion/test_qwen3_moe.py).
FAMILIES = [n for n in supported_model_types() if not _FAMILIES.get(n).num_experts(_config(n))]


def _scale_qk(model, family: str) -> None:
    """Make attention peaked: q/k projections (or Qwen3's per-head norms, which undo a projection scale)."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "q_norm"):  # Qwen3's per-head norms
                attn.q_norm.weight.mul_(3.0)
                attn.k_norm.weight.mul_(3.0)
            else:
                for proj in (attn.q_proj, attn.k_proj):
                    proj.weight.mul_(12.0)


def _make_hf_dir(root: Path, family: str, scaled: bool) -> Path:
    from transformers import AutoModelForCausalLM

    out = root / f"{family}{'_scaled' if scaled else ''}"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    if scaled:
        _scale_qk(model, family)
    model.save_pretrained(out)
    return out


def _batch():
    """input_ids [B, S], 2-D mask [B, S] (1 = token), position ids [B, S] counted from the first token."""
    g = torch.Generator().manual_seed(1)
    s = max(LENGTHS)
    ids = torch.randint(0, 160, (len(LENGTHS), s), generator=g)
    mask = torch.zeros(len(LENGTHS), s, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        mask[b, s - n:] = 1
    ids = ids * mask  # pad id 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _hf_logits(hf_dir: Path, *, attentions: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    ids, mask, pos = _batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_attentions=attentions)
    return out


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    _, mask, _ = _batch()
    valid = mask.bool()
    return ((got[valid] - want[valid]).abs().max() / want[valid].abs().max()).item()


# --- worker side (runs on every rank of the gloo pool) --------------------------------------------
def _megatron_logits(hf_dir: str, tp: int, pp: int, *, ckpt_dir: str | None = None, corrupt: str | None = None):
    """Logits [B, S, V] of the converted model on this rank's layout (None on non-last PP stages)."""
    import copy

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.conversion import family_for_config, load_hf_into_local_state
    from megatron_credit.conversion.model_io import build_model, load_dist_checkpoint, load_hf_config
    from megatron_credit.conversion.hf_io import SafetensorsReader
    from megatron_credit.conversion.transforms import TPSplit, tp_shard

    distributed.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    try:
        cfg = load_hf_config(hf_dir)
        model_cfg = cfg
        if corrupt == "rope":  # a RoPE base that is off by 2x: the classic wrong-rope_theta bug
            model_cfg = copy.deepcopy(cfg)
            model_cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": cfg.rope_parameters["rope_theta"] * 2}
        model = build_model(model_cfg, params_dtype=torch.float32, tp=tp, pp=pp)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        offset = pp_rank * cfg.num_hidden_layers // pp
        if ckpt_dir is not None:
            load_dist_checkpoint(model, ckpt_dir)
        else:
            reader = SafetensorsReader(hf_dir)
            state = model.state_dict(keep_vars=True)
            load_hf_into_local_state(state, reader.get, family_for_config(cfg), cfg, tp_rank=tp_rank,
                                     tp_size=tp, layer_offset=offset)
            if corrupt == "qkv":  # [q; k; v] stacked whole instead of grouped per query group
                with torch.no_grad():
                    for name, p in state.items():
                        if name.endswith("linear_qkv.weight"):
                            i = int(name.split(".")[2]) + offset
                            full = torch.cat([reader.get(f"model.layers.{i}.self_attn.{x}_proj.weight")
                                              for x in "qkv"])
                            p.copy_(tp_shard(full, TPSplit.ROWS, rank=tp_rank, size=tp))
        model.eval()
        ids, mask, pos = _batch()
        s = ids.shape[1]
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
        allowed = causal & (mask.bool()[:, None, :] | torch.eye(s, dtype=torch.bool))  # [B, S, S]
        attn_mask = ~allowed[:, None]  # megatron: True = masked out, [B, 1, S, S]
        return pipeline_forward(model, ids, pos, attn_mask, hidden_size=cfg.hidden_size)
    finally:
        distributed.destroy()


def _last(results: list):
    outs = [r for r in results if r is not None]
    assert outs and all(torch.equal(o, outs[0]) for o in outs)
    return outs[0]
