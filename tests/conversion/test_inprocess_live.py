"""HF weights in and out of a live model (``conversion.live``) and a training run's checkpoint -> HF
(``conversion.run_export``), run in the pytest process.

``tests/conversion/test_live.py`` checks the weight-sync generator on spawned gloo workers; here the same
contracts run where ``make mutation`` can trace them: TP = 2, PP = 2 and TP = PP = 2 on a
:class:`tests.support.threaded_harness.ThreadedPool` (ranks as threads), and world size 1 on a real megatron
``GPTModel``. Every HF tensor holds values no other element of the model holds, so a tensor taken from
the wrong layer, rank, stage or slot cannot pass. The run export reads a checkpoint written by the
trainer's own ``trainer.checkpoint.save`` (model, AdamW moments, a PPO value head) and must give back the
HF weights the actor was loaded from, bit for bit.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests.support.threaded_harness import ThreadedPool

BUCKET = 12_000  # bytes: many buckets for the tiny models, the embedding alone in its own
PAD = 4  # vocabulary padding rows of a hand-built rank state (the exporter must drop them)


# --- the source model: unique HF weights ----------------------------------------------------------

def _unique_hf_state(cfg) -> dict[str, torch.Tensor]:
    """HF tensors of ``cfg``'s model; element ``j`` of the whole model is ``j / 1024`` (float32-exact)."""
    from megatron_credit.conversion.testing import hf_parameter_shapes

    state, start = {}, 1
    for name, shape in hf_parameter_shapes(cfg).items():
        n = torch.Size(shape).numel()
        state[name] = (torch.arange(start, start + n, dtype=torch.float64) / 1024).float().reshape(shape)
        start += n
    assert start < 2 ** 24  # every value exact in float32
    return state


def _tiny(family: str, tied: bool):
    from megatron_credit.conversion import FAMILIES
    from megatron_credit.conversion.testing import tiny_hf_config

    cfg = tiny_hf_config(family, vocab_size=160, tie_word_embeddings=tied)
    return cfg, _unique_hf_state(cfg), FAMILIES.get(family)


_EXPERT_INDEX = re.compile(r"(local_experts\.|experts\.linear_fc[12]\.weight)(\d+)")  # SequentialMLP, TEGroupedMLP


def _rank_state(family: str, tied: bool, *, tp: int, pp: int, tp_rank: int, pp_rank: int,
                pad_value: float, ep: int = 1, ep_rank: int = 0, grouped: bool = False) -> tuple[dict, int]:
    """One rank's megatron state dict, sliced here (not by the library's loaders); its layer offset.

    Layers are numbered locally, fc1 is ``[gate_r; up_r]``, the vocabulary has ``PAD`` rows of
    ``pad_value``, a tied model's last stage (PP > 1) holds a copy of the embedding as its head. A mixture
    of experts' EP rank holds experts ``ep_rank E / ep ...`` numbered from 0, under ``SequentialMLP``'s
    names or (``grouped``) ``TEGroupedMLP``'s."""
    from megatron_credit.conversion import iter_megatron_from_hf

    cfg, hf, fam = _tiny(family, tied)
    full = dict(iter_megatron_from_hf(hf.__getitem__, fam, cfg, grouped_experts=grouped))
    per_stage = cfg.num_hidden_layers // pp
    per_ep = getattr(cfg, "num_experts", 0) // ep
    first, last = pp_rank == 0, pp_rank == pp - 1
    if tied and last and pp > 1:
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    local = {}
    for name, t in full.items():
        expert = _EXPERT_INDEX.search(name)
        if expert:
            e = int(expert.group(2))
            if e // per_ep != ep_rank:
                continue
            name = name[:expert.start(2)] + str(e - ep_rank * per_ep) + name[expert.end(2):]
        if name.startswith("decoder.layers."):
            i = int(name.split(".")[2])
            if i // per_stage != pp_rank:
                continue
            name = name.replace(f"layers.{i}.", f"layers.{i - pp_rank * per_stage}.", 1)
        elif name.startswith("embedding.") and not first:
            continue
        elif name.startswith(("output_layer.", "decoder.final_layernorm.")) and not last:
            continue
        if name.startswith(("embedding.", "output_layer.")):
            t = torch.cat([t, torch.full((PAD, t.shape[1]), pad_value)])
        if "linear_fc1" in name:
            gate, up = t.chunk(2)
            t = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
        elif "linear_qkv" in name or name.startswith(("embedding.", "output_layer.")):
            t = t.chunk(tp)[tp_rank]
        elif re.search(r"(linear_proj|linear_fc2)\.weight\d*$", name):
            t = t.chunk(tp, dim=1)[tp_rank]
        local[name] = t.clone()
    local["decoder.layers.0.self_attention.core_attention._extra_state"] = None  # TE-style entry: no weights
    return local, pp_rank * per_stage


def _hf_order(names: list[str], cfg, tied: bool) -> None:
    """The documented order: embedding, the layers in order, final norm, head (untied only)."""
    assert names[0] == "model.embed_tokens.weight"
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers) and set(layers) == set(range(cfg.num_hidden_layers))
    tail = ["model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    assert names[-len(tail):] == tail


def _check_buckets(buckets, hf: dict, cfg, tied: bool) -> None:
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(hf) and len(names) == len(set(names))
    _hf_order(names, cfg, tied)
    from megatron_credit.rollout.weight_sync import sync_group

    sizes = [[t.numel() * t.element_size() for _, t in b] for b in buckets]
    groups = [[sync_group(n) for n, _ in b] for b in buckets]
    for g, nxt in zip(groups, groups[1:]):  # never a fused group (one decoder layer) across two buckets
        assert g[-1] != nxt[0] and not set(g) & set(nxt)
    for s, g in zip(sizes, groups):  # over the size only by the tensors of the group that opened the bucket
        assert len(s) >= 1 and sum(x for x, gg in zip(s, g) if gg != g[0]) <= BUCKET or len(set(g)) == 1
    for s, nxt in zip(sizes, sizes[1:]):  # a bucket is closed only when the next tensor does not fit
        assert sum(s) + nxt[0] > BUCKET
    assert len(buckets) > 3
    for b in buckets:
        for n, t in b:
            assert t.dtype == hf[n].dtype and torch.equal(t, hf[n]), n


# --- TP / PP on threads ---------------------------------------------------------------------------

def _groups(tp: int, pp: int):
    """This rank's (tp_group, pp_group, tp_rank, pp_rank), megatron's order (TP fastest); None for size 1."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tp_rank, pp_rank = rank % tp, rank // tp
    tp_group = pp_group = None
    if tp > 1:
        for p in range(pp):  # every rank creates every group, in the same order
            g = dist.new_group([p * tp + t for t in range(tp)])
            tp_group = g if p == pp_rank else tp_group
    if pp > 1:
        for t in range(tp):
            g = dist.new_group([p * tp + t for p in range(pp)])
            pp_group = g if t == tp_rank else pp_group
    return tp_group, pp_group, tp_rank, pp_rank


def _load_and_export(family: str, tied: bool, tp: int, pp: int):
    """Per rank: the names ``load_hf_into_local_state`` filled wrongly (vs the hand-sliced state), and
    the buckets exported from the hand-sliced state (its keys in reverse order, padding rows of 7)."""
    from megatron_credit.conversion import iter_hf_weight_buckets, load_hf_into_local_state

    tp_group, pp_group, tp_rank, pp_rank = _groups(tp, pp)
    cfg, hf, fam = _tiny(family, tied)
    want, offset = _rank_state(family, tied, tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank, pad_value=0.0)
    got = {k: (torch.full_like(v, float("nan")) if v is not None else None) for k, v in want.items()}
    load_hf_into_local_state(got, hf.__getitem__, fam, cfg, tp_rank=tp_rank, tp_size=tp, layer_offset=offset)
    wrong = [k for k, v in want.items() if v is not None and not torch.equal(got[k], v)]
    local, _ = _rank_state(family, tied, tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank, pad_value=7.0)
    local = dict(reversed(list(local.items())))  # a mapping: its order is not part of the contract
    buckets = iter_hf_weight_buckets(local, fam, cfg, tp_group=tp_group, pp_group=pp_group, layer_offset=offset,
                                     bucket_bytes=BUCKET)
    return wrong, [[(n, t.clone()) for n, t in b] for b in buckets]


@pytest.mark.parametrize("family,tied,tp,pp", [("qwen2", False, 2, 1), ("qwen2", False, 1, 2),
                                               ("qwen3", True, 1, 2), ("qwen3", True, 2, 2),
                                               ("llama", False, 2, 2)])
def test_sharded_state_loads_and_exports_the_hf_weights_on_every_rank(family, tied, tp, pp):
    cfg, hf, _ = _tiny(family, tied)
    results = ThreadedPool(world_size=tp * pp, timeout_s=10).run(_load_and_export, family, tied, tp, pp)
    for rank, (wrong, buckets) in enumerate(results):
        assert wrong == [], (rank, wrong)
        _check_buckets(buckets, hf, cfg, tied)
    first = [[n for n, _ in b] for b in results[0][1]]
    assert all([[n for n, _ in b] for b in buckets] == first for _, buckets in results)


def _export_with_offset_zero():
    """PP = 2 with both stages claiming layer offset 0: the refusal's message on each rank."""
    import torch.distributed as dist

    from megatron_credit.conversion import iter_hf_weight_buckets

    _, pp_group, _, pp_rank = _groups(1, 2)
    cfg, _, fam = _tiny("qwen2", False)
    local, _ = _rank_state("qwen2", False, tp=1, pp=2, tp_rank=0, pp_rank=pp_rank, pad_value=0.0)
    try:
        next(iter_hf_weight_buckets(local, fam, cfg, pp_group=pp_group, layer_offset=0))
    except ValueError as exc:
        return dist.get_rank(), str(exc)
    return dist.get_rank(), None


def test_two_stages_holding_the_same_layer_are_refused():
    results = ThreadedPool(world_size=2, timeout_s=10).run(_export_with_offset_zero)
    for _, msg in results:
        assert msg == ("pipeline stages 0 and 1 both hold 'decoder.layers.0.input_layernorm.weight': "
                       "is layer_offset right on every stage?")


def _experts_load_and_export(tp: int, ep: int, grouped: bool):
    """Per rank of TP x EP (TP fastest, megatron's order) on a tiny Qwen3-MoE: the names
    ``load_hf_into_local_state`` filled wrongly, this rank's fc2 of its second local expert in layer 1 as
    loaded, and the buckets exported from the hand-sliced state."""
    import torch.distributed as dist

    from megatron_credit.conversion import iter_hf_weight_buckets, load_hf_into_local_state

    rank = dist.get_rank()
    tp_rank, ep_rank = rank % tp, rank // tp
    tp_group = ep_group = None
    for e in range(ep) if tp > 1 else ():  # every rank creates every group, in the same order
        g = dist.new_group([e * tp + t for t in range(tp)])
        tp_group = g if e == ep_rank else tp_group
    for t in range(tp) if ep > 1 else ():
        g = dist.new_group([e * tp + t for e in range(ep)])
        ep_group = g if t == tp_rank else ep_group
    cfg, hf, fam = _tiny("qwen3_moe", False)
    kw = dict(tp=tp, pp=1, tp_rank=tp_rank, pp_rank=0, ep=ep, ep_rank=ep_rank, grouped=grouped)
    want, _ = _rank_state("qwen3_moe", False, pad_value=0.0, **kw)
    got = {k: (torch.full_like(v, float("nan")) if v is not None else None) for k, v in want.items()}
    load_hf_into_local_state(got, hf.__getitem__, fam, cfg, tp_rank=tp_rank, tp_size=tp, layer_offset=0,
                             ep_rank=ep_rank, ep_size=ep)
    wrong = [k for k, v in want.items() if v is not None and not torch.equal(got[k], v)]
    fc2 = "decoder.layers.1.mlp.experts." + ("linear_fc2.weight1" if grouped else "local_experts.1.linear_fc2.weight")
    local, _ = _rank_state("qwen3_moe", False, pad_value=7.0, **kw)
    buckets = iter_hf_weight_buckets(local, fam, cfg, tp_group=tp_group, ep_group=ep_group, bucket_bytes=BUCKET)
    return wrong, got[fc2].clone(), [[(n, t.clone()) for n, t in b] for b in buckets]


@pytest.mark.parametrize("tp,ep,grouped", [(1, 2, True), (2, 2, True), (1, 2, False)])
def test_expert_parallel_ranks_load_and_export_their_experts_under_either_naming(tp, ep, grouped):
    """EP rank ``r`` holds experts ``2r, 2r + 1`` of 4 as its local 0 and 1, whether named as megatron's
    ``SequentialMLP`` (local spec) or ``TEGroupedMLP`` (TE's grouped GEMM) names them; every rank loads its
    own and every rank's buckets are the whole HF model."""
    cfg, hf, _ = _tiny("qwen3_moe", False)
    assert cfg.num_experts == 4
    results = ThreadedPool(world_size=tp * ep, timeout_s=20).run(_experts_load_and_export, tp, ep, grouped)
    for rank, (wrong, fc2, buckets) in enumerate(results):
        assert wrong == [], (rank, wrong)
        down = hf[f"model.layers.1.mlp.experts.{2 * (rank // tp) + 1}.down_proj.weight"]  # global expert 2r + 1
        assert torch.equal(fc2, down.chunk(tp, dim=1)[rank % tp]), rank
        _check_buckets(buckets, hf, cfg, tied=False)


# --- world size 1 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world1():
    """A real megatron GPTModel (TP = PP = 1) filled by
    ``load_hf_into_local_state``; its buckets over the model's own 1-rank groups; a copy of its state."""
    from megatron.core import parallel_state as ps

    from megatron_credit.conversion import iter_hf_weight_buckets, load_hf_into_local_state
    from megatron_credit.conversion.model_io import build_model, single_stage_parallel_state

    cfg, hf, fam = _tiny("qwen2", False)
    with single_stage_parallel_state():
        model = build_model(cfg, params_dtype=torch.float32)
        load_hf_into_local_state(model.state_dict(keep_vars=True), hf.__getitem__, fam, cfg, tp_rank=0, tp_size=1,
                                 layer_offset=0)
        buckets = [[(n, t.clone()) for n, t in b] for b in iter_hf_weight_buckets(
            model.state_dict(), fam, cfg, tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(), bucket_bytes=BUCKET)]
        state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in model.state_dict().items()}
    return cfg, hf, fam, buckets, state


def test_real_model_round_trips_through_its_one_rank_groups(world1):
    cfg, hf, _, buckets, state = world1
    _check_buckets(buckets, hf, cfg, tied=False)
    assert torch.equal(state["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(state["decoder.layers.1.mlp.linear_fc2.weight"], hf["model.layers.1.mlp.down_proj.weight"])


def test_no_process_group_means_size_one(world1):
    """``None`` groups work without any torch.distributed set up (a single process, no collectives)."""
    import torch.distributed as dist

    from megatron_credit.conversion import iter_hf_weight_buckets

    cfg, hf, fam, _, state = world1
    assert not dist.is_initialized()
    _check_buckets(list(iter_hf_weight_buckets(state, fam, cfg, bucket_bytes=BUCKET)), hf, cfg, tied=False)
    # One bucket when everything fits; a tensor larger than the bucket is a bucket of its own.
    (whole,) = iter_hf_weight_buckets(state, fam, cfg)
    assert [n for n, _ in whole] == [n for b in world1[3] for n, _ in b]
    tiny = list(iter_hf_weight_buckets(state, fam, cfg, bucket_bytes=1))
    from megatron_credit.rollout.weight_sync import sync_group

    names = [n for b in world1[3] for n, _ in b]  # with 1-byte buckets: one bucket per sync group
    want: list[list[str]] = []
    for n in names:
        if want and sync_group(want[-1][-1]) == sync_group(n):
            want[-1].append(n)
        else:
            want.append([n])
    assert [[n for n, _ in b] for b in tiny] == want and any(len(b) > 1 for b in want)


def test_transformer_engine_names_are_read_as_fused_norms(world1):
    from megatron_credit.conversion import iter_hf_weight_buckets, load_hf_into_local_state
    from megatron_credit.conversion.live import uses_fused_norms
    from megatron_credit.conversion.streaming import expand_rules

    cfg, hf, fam, _, state = world1
    te_name = {a: b for (a, _, _), (b, _, _) in zip(expand_rules(fam, cfg), expand_rules(fam, cfg, fused_norms=True))}
    assert any(a != b for a, b in te_name.items())
    te = {te_name.get(k, k): v for k, v in state.items()}
    assert uses_fused_norms(te) and not uses_fused_norms(state)
    _check_buckets(list(iter_hf_weight_buckets(te, fam, cfg, bucket_bytes=BUCKET)), hf, cfg, tied=False)
    empty = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in te.items()}
    load_hf_into_local_state(empty, hf.__getitem__, fam, cfg, tp_rank=0, tp_size=1, layer_offset=0)
    assert all(torch.equal(empty[k], te[k]) for k, v in te.items() if isinstance(v, torch.Tensor))


def test_name_mapping_and_state_dict_helpers():
    from megatron_credit.conversion.live import parameter_names, to_global_name, to_local_name, uses_fused_norms

    assert to_global_name("decoder.layers.3.mlp.linear_fc1.weight", 8) == "decoder.layers.11.mlp.linear_fc1.weight"
    assert to_local_name("decoder.layers.11.mlp.linear_fc1.weight", 8) == "decoder.layers.3.mlp.linear_fc1.weight"
    assert to_global_name("decoder.layers.0.self_attention.linear_qkv.bias", 0) == \
        "decoder.layers.0.self_attention.linear_qkv.bias"
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"):
        assert to_global_name(name, 8) == name and to_local_name(name, 8) == name
    # Only the leading layer index is renumbered.
    assert to_global_name("decoder.layers.2.mlp.experts.7.weight", 10) == "decoder.layers.12.mlp.experts.7.weight"
    assert to_local_name(to_global_name("decoder.layers.5.x", 27), 27) == "decoder.layers.5.x"

    state = {"decoder.layers.0.self_attention.linear_qkv.weight": 1, "decoder.layers.0.mlp.linear_fc1._extra_state": 2,
             "output_layer._extra_state": 3, "decoder.final_layernorm.weight": 4}
    assert parameter_names(state) == ["decoder.layers.0.self_attention.linear_qkv.weight",
                                      "decoder.final_layernorm.weight"]
    assert uses_fused_norms({"decoder.layers.0.mlp.linear_fc1.layer_norm_weight": 0, "x": 1})
    assert not uses_fused_norms({"decoder.layers.0.pre_mlp_layernorm.weight": 0, "decoder.layers.0.mlp.norm": 1})
    assert not uses_fused_norms({})


def test_full_shape_of_a_shard():
    from megatron_credit.conversion.live import _full_shape
    from megatron_credit.conversion.transforms import TPSplit

    assert _full_shape((5, 3), TPSplit.ROWS, 2) == (10, 3)
    assert _full_shape((5, 3), TPSplit.GATED_ROWS, 4) == (20, 3)
    assert _full_shape((7,), TPSplit.ROWS, 2) == (14,)
    assert _full_shape((5, 3), TPSplit.COLS, 2) == (5, 6)
    assert _full_shape((5, 3), TPSplit.REPLICATED, 2) == (5, 3)
    for split in TPSplit:
        assert _full_shape((5, 3), split, 1) == (5, 3)


def test_refusals_of_the_live_helpers(world1):
    from megatron_credit.conversion import iter_hf_weight_buckets, load_hf_into_local_state

    cfg, hf, fam, _, state = world1
    with pytest.raises(ValueError, match=r"^bucket_bytes must be positive, got -1$"):
        next(iter_hf_weight_buckets(state, fam, cfg, bucket_bytes=-1))
    partial = {k: v for k, v in state.items() if k != "decoder.final_layernorm.weight"}
    with pytest.raises(ValueError, match=r"^no pipeline stage holds 'decoder\.final_layernorm\.weight'; "
                                         r"is the model built for this config\?$"):
        list(iter_hf_weight_buckets(partial, fam, cfg))

    def fresh():
        return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}

    extra = fresh()
    extra["decoder.layers.9.mlp.linear_fc9.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"^parameters not filled from the HF checkpoint: "
                                         r"\['decoder\.layers\.9\.mlp\.linear_fc9\.weight'\]$"):
        load_hf_into_local_state(extra, hf.__getitem__, fam, cfg, tp_rank=0, tp_size=1, layer_offset=0)
    short = fresh()
    short["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(64, 48)  # half of fc2's 96 columns
    with pytest.raises(ValueError, match=r"^decoder\.layers\.0\.mlp\.linear_fc2\.weight: converted shard \(64, 96\) "
                                         r"!= parameter \(64, 48\) \(tp_rank=0/1\)$"):
        load_hf_into_local_state(short, hf.__getitem__, fam, cfg, tp_rank=0, tp_size=1, layer_offset=0)


# --- run_export: a run's checkpoint -> HF ---------------------------------------------------------

RUN_ARCH = dict(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                rope_theta=1e4, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])


def _write_config_yaml(run_dir, model: dict) -> None:
    import yaml

    from megatron_credit.recipe.config import recipe_from_dict, recipe_to_dict

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "config.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump(recipe_to_dict(recipe_from_dict({"model": model})), f, sort_keys=False)


def _hand_checkpoint(run_dir, edit) -> tuple[str, dict[str, torch.Tensor]]:
    """``<run>/checkpoints/iter_0000001`` holding a TP = 1 model loaded with unique HF weights (returned),
    ``edit(sharded_state_dict)`` applied before the save (to write what the trainer never would)."""
    from megatron.core import dist_checkpointing

    from megatron_credit.recipe.config import ModelConfig
    from megatron_credit.conversion import family_for_config, load_hf_into_local_state
    from megatron_credit.conversion.mcore_save import _save_strategy, _whole_gated_fc1
    from megatron_credit.conversion.model_io import build_model, single_stage_parallel_state

    _write_config_yaml(run_dir, {"architecture": RUN_ARCH, "params_dtype": "float32"})
    ckpt = run_dir / "checkpoints" / "iter_0000001"
    (ckpt / "model_optim").mkdir(parents=True)
    cfg = ModelConfig(architecture=RUN_ARCH).hf_config()
    hf = _unique_hf_state(cfg)
    with single_stage_parallel_state():
        model = build_model(cfg, params_dtype=torch.float32)
        load_hf_into_local_state(model.state_dict(keep_vars=True), hf.__getitem__, family_for_config(cfg), cfg,
                                 tp_rank=0, tp_size=1, layer_offset=0)
        sd = _whole_gated_fc1(model.sharded_state_dict())
        edit(sd)
        dist_checkpointing.save(sd, str(ckpt / "model_optim"), sharded_strategy=_save_strategy())
    (ckpt / "meta.json").write_text("{}")
    return str(ckpt), hf


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder written the trainer's way: a PPO actor (value head) at world size 1 loaded with
    unique HF weights, saved by ``trainer.checkpoint.save``, and its resolved ``config.yaml``."""
    return _trainer_run(tmp_path_factory.mktemp("run_export"), "float32")


def _trainer_run(root, params_dtype: str):
    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.conversion import family_for_config, load_hf_into_local_state
    from megatron_credit.trainer import checkpoint as trainer_ckpt
    from megatron_credit.trainer.actor import Actor

    run_dir = root / "run"
    model = {"architecture": RUN_ARCH, "params_dtype": params_dtype}
    recipe = recipe_from_dict({"model": model})
    _write_config_yaml(run_dir, model)
    cfg = recipe.model.hf_config()
    hf = _unique_hf_state(cfg)
    device = distributed.initialize(recipe.parallel, seed=0)
    try:
        from megatron_credit.trainer.loop import actor_settings

        actor = Actor(hf_config=cfg, **actor_settings(recipe), device=device, with_critic=True, with_reference=False)
        local = {k: v for k, v in actor.model.state_dict(keep_vars=True).items() if not k.startswith("value_head.")}
        load_hf_into_local_state(local, hf.__getitem__, family_for_config(cfg), cfg, tp_rank=0, tp_size=1,
                                 layer_offset=0)
        actor.sync_optimizer_from_model()
        with torch.no_grad():
            actor.model.value_head.weight.fill_(3.0)  # stored next to the policy, never exported
        ckpt = trainer_ckpt.save(str(run_dir), 4, actor, {"note": torch.zeros(1)},
                                 layout={"tp": 1, "pp": 1, "cp": 1, "dp": 1}, keep=3)
    finally:
        distributed.destroy(process_group=True)
    return root, run_dir, ckpt, cfg, hf


def _read_hf(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_newest_checkpoint_is_the_highest_complete_iteration(run, tmp_path):
    from megatron_credit.conversion.run_export import newest_checkpoint

    _, run_dir, ckpt, _, _ = run
    assert newest_checkpoint(run_dir) == ckpt == str(run_dir / "checkpoints" / "iter_0000004")
    assert newest_checkpoint(str(run_dir)) == ckpt
    root = tmp_path / "r"
    for name, complete in [("iter_0000002", True), ("iter_0000010", True), ("iter_0000009", True),
                           ("iter_0000011", False), ("iter_0000012.tmp", True), ("iter_13", True)]:
        (root / "checkpoints" / name).mkdir(parents=True)
        if complete:
            (root / "checkpoints" / name / "meta.json").write_text("{}")
    assert newest_checkpoint(root) == str(root / "checkpoints" / "iter_0000010")


def test_newest_checkpoint_refuses_a_run_without_one(tmp_path):
    from megatron_credit.conversion.run_export import newest_checkpoint

    where = re.escape(repr(str(tmp_path / "checkpoints")))
    with pytest.raises(FileNotFoundError, match=rf"^no complete checkpoint under {where}$"):
        newest_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "iter_0000003.tmp").mkdir(parents=True)
    (tmp_path / "checkpoints" / "iter_0000003.tmp" / "meta.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"^no complete checkpoint under {where}$"):
        newest_checkpoint(str(tmp_path))


def test_export_gives_back_the_actor_s_hf_weights(run):
    from megatron_credit.conversion.run_export import export_run_checkpoint

    root, run_dir, ckpt, cfg, hf = run
    out = root / "exports" / "new" / "hf"  # parents created
    assert export_run_checkpoint(ckpt, out) == ["model.safetensors"]
    got = _read_hf(out)
    assert sorted(got) == sorted(hf)  # no value head, no optimizer moment
    for k, v in hf.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == "float32"
    # an inline architecture gets its transformers class (convert_megatron_to_hf needs it)
    assert written["architectures"] == (cfg.architectures or [type(cfg).__name__.removesuffix("Config") + "ForCausalLM"])
    assert {k: v for k, v in written.items() if k not in ("dtype", "architectures")} == \
        {k: v for k, v in json.loads(cfg.to_json_string()).items() if k not in ("dtype", "architectures")}
    # no tokenizer named; the manifest of what the export wrote (conversion/export_target.py)
    assert sorted(p.name for p in out.iterdir()) == [".megatron_credit_export.json", "config.json", "model.safetensors"]


def test_export_of_a_bf16_run_reads_the_model_past_its_fp32_optimizer_state(tmp_path):
    # A bf16 run stores fp32 AdamW moments and master weights (and a value head) next to its bf16 weights:
    # only the model's tensors decide the export's dtype.
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_credit.conversion.run_export import export_run_checkpoint

    _, _, ckpt, _, hf = _trainer_run(tmp_path, "bfloat16")
    stored = FileSystemReader(f"{ckpt}/model_optim").read_metadata().state_dict_metadata
    assert {str(m.properties.dtype) for k, m in stored.items() if k.startswith("optimizer.")} == {"torch.float32"}
    assert export_run_checkpoint(ckpt, tmp_path / "hf") == ["model.safetensors"]
    got = _read_hf(tmp_path / "hf")
    assert sorted(got) == sorted(hf)
    for k, v in hf.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_refuses_a_checkpoint_without_a_word_embedding(tmp_path):
    from megatron_credit.conversion.hf_io import CheckpointFormatError
    from megatron_credit.conversion.run_export import export_run_checkpoint

    def drop_embedding(sd):
        del sd["embedding.word_embeddings.weight"]

    ckpt, _ = _hand_checkpoint(tmp_path / "run", drop_embedding)
    where = re.escape(repr(f"{ckpt}/model_optim"))
    with pytest.raises(CheckpointFormatError, match=rf"^{where} stores no 'embedding\.word_embeddings\.weight' "
                                                    r"tensor: not a GPT model checkpoint$"):
        export_run_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_in_shards_into_an_existing_folder_with_the_tokenizer_of_the_run_s_model(run):
    """``run_dir`` given (a run whose ``model.name_or_path`` is a local HF folder): its tokenizer files
    are copied; small ``max_shard_bytes``: several shards and an index, into a folder that exists."""
    from megatron_credit.conversion.run_export import export_run_checkpoint

    root, _, ckpt, cfg, hf = run
    source = root / "hf_source"
    source.mkdir()
    cfg.to_json_file(str(source / "config.json"))
    (source / "tokenizer.json").write_bytes(b'{"model": "tiny"}\n')
    (source / "tokenizer_config.json").write_bytes(b'{"bos_token": "<s>"}\n')
    other = root / "other_run"
    _write_config_yaml(other, {"name_or_path": str(source), "params_dtype": "float32"})
    out = root / "exports" / "sharded"
    out.mkdir(parents=True)
    files = export_run_checkpoint(ckpt, out, run_dir=other, max_shard_bytes=40_000)
    assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                        for i in range(1, len(files) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(hf) and set(index["weight_map"].values()) == set(files)
    got = _read_hf(out)
    assert sorted(got) == sorted(hf) and all(torch.equal(got[k], v) for k, v in hf.items())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_export_refuses_what_is_not_a_run_checkpoint(run, tmp_path):
    from megatron_credit.conversion.run_export import export_run_checkpoint

    root, run_dir, ckpt, _, _ = run
    half = run_dir / "checkpoints" / "iter_0000005.tmp"
    half.mkdir()
    try:
        with pytest.raises(FileNotFoundError, match=rf"^{re.escape(repr(str(half)))} is not a complete run "
                                                    r"checkpoint \(no meta\.json\)$"):
            export_run_checkpoint(half, tmp_path / "a")
    finally:
        shutil.rmtree(half)
    with pytest.raises(FileNotFoundError, match=rf"^no config\.yaml in the run directory "
                                                rf"{re.escape(repr(str(tmp_path)))}$"):
        export_run_checkpoint(ckpt, tmp_path / "b", run_dir=tmp_path)
    inside = f"{ckpt}/hf"
    with pytest.raises(ValueError, match=rf"^--out {re.escape(repr(inside))} is inside the source folder "
                                         rf"{re.escape(repr(ckpt))}; choose a folder outside it$"):
        export_run_checkpoint(ckpt, inside)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (root / inside).exists()


def test_export_refuses_a_config_that_does_not_match_the_checkpoint(run):
    """A ``run_dir`` naming another model (qwen3's q/k norms): the weights it lacks are named."""
    from megatron_credit.conversion.run_export import export_run_checkpoint

    root, _, ckpt, _, _ = run
    wrong = root / "qwen3_run"
    _write_config_yaml(wrong, {"architecture": dict(RUN_ARCH, model_type="qwen3", head_dim=8,
                                                    architectures=["Qwen3ForCausalLM"]), "params_dtype": "float32"})
    where = re.escape(repr(f"{ckpt}/model_optim"))
    with pytest.raises(ValueError, match=rf"^run checkpoint {where}: keys stored but not in the model: \[\]; "
                                         r"keys of the model not stored: "
                                         r"\['decoder\.layers\.self_attention\.k_layernorm\.weight', "
                                         r"'decoder\.layers\.self_attention\.q_layernorm\.weight'\] "
                                         r"\(only TE _extra_state may differ\)$"):
        export_run_checkpoint(ckpt, root / "exports" / "qwen3", run_dir=wrong)


def test_export_refuses_weights_of_several_dtypes(tmp_path):
    from megatron_credit.conversion.run_export import export_run_checkpoint

    def half_head(sd):
        sd["output_layer.weight"].data = sd["output_layer.weight"].data.to(torch.bfloat16)

    ckpt, _ = _hand_checkpoint(tmp_path / "run", half_head)
    where = re.escape(repr(f"{ckpt}/model_optim"))
    with pytest.raises(ValueError, match=rf"^{where} stores tensors of several dtypes "
                                         r"\['torch\.bfloat16', 'torch\.float32'\]$"):
        export_run_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_refuses_a_byte_item_that_would_build_objects(tmp_path):
    """An ``_extra_state`` byte item that needs more than weights-only unpickling is never loaded."""
    import datetime

    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_credit.conversion.run_export import export_run_checkpoint
    from megatron_credit.conversion.safe_load import UnsafeCheckpointError

    def poison(sd):
        obj = next(v for v in sd.values() if isinstance(v, ShardedObject))
        obj.data = datetime.date(2020, 1, 1)

    ckpt, _ = _hand_checkpoint(tmp_path / "run", poison)
    where = re.escape(str(tmp_path / "run" / "checkpoints" / "iter_0000001" / "model_optim"))
    with pytest.raises(UnsafeCheckpointError, match=rf"{where}.*byte item .* does not load with weights_only=True"):
        export_run_checkpoint(ckpt, tmp_path / "hf")


def test_export_tolerates_a_missing_extra_state(tmp_path):
    """A checkpoint without one of the local model's ``_extra_state`` entries (TE metadata, no weights:
    a Transformer Engine run stores other ones) exports, bit for bit."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_credit.conversion.run_export import export_run_checkpoint

    dropped = []

    def drop_extra_state(sd):
        key = next(v.key for v in sd.values() if isinstance(v, ShardedObject) and v.key.endswith("_extra_state"))
        for k in [k for k, v in sd.items() if isinstance(v, ShardedObject) and v.key == key]:  # every layer's
            dropped.append(k)
            del sd[k]

    ckpt, hf = _hand_checkpoint(tmp_path / "run", drop_extra_state)
    assert dropped
    assert export_run_checkpoint(ckpt, tmp_path / "hf") == ["model.safetensors"]
    got = _read_hf(tmp_path / "hf")
    assert sorted(got) == sorted(hf) and all(torch.equal(got[k], v) for k, v in hf.items())
