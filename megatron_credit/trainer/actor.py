"""The actor: the megatron-facing file of the trainer (model, value head, optimizer, forward-backward
schedules; the lr schedule, megatron's scheduler, is ``trainer/schedule.py``, the optimizer's parameter
groups ``trainer/optimizer_groups.py``). A separate PPO critic is an ``Actor`` too (``role="critic"``,
``trainer/critic_model.py``).

Everything megatron-specific the RL iteration needs is here: building this rank's pipeline stage of the
``GPTModel`` (plus a value head on the last stage for critic algorithms and an optional frozen
reference copy), running micro-batches through megatron's forward-backward schedule (PP), the gradient
reduction, the global gradient norm, clipping, the AdamW step, and the HF-named weight stream for the
rollout engine (the weights in and out and the KL reference in the mixin ``trainer/actor_weights.py``).
:mod:`megatron_credit.trainer.step` calls it and never imports megatron.

The loss contract (one derivation, one place: :meth:`Actor.run`). Each micro-batch's loss function
returns ``aggregate_loss(l, m, global_num_tokens=N, ...)``: the micro-batch's share of the loss of the
whole mini-batch, with denominators summed over every micro-batch and DP rank beforehand
(:mod:`megatron_credit.batch.train_batch`). The TransformerConfig sets ``calculate_per_token_loss=True``,
so megatron's ``forward_step_calc_loss`` neither divides by the token count the loss function returns
nor by the number of micro-batches, and backpropagates the loss as it is: after the schedule, each
rank's gradient buffer holds the gradient of the sum of its micro-batches' shares.

Gradients: the policy is wrapped in megatron-core's ``DistributedDataParallel`` (fp32 gradient
buffers, ``param.main_grad``, accumulated over micro-batches), and :meth:`Actor.optimizer_step` calls
megatron's ``finalize_model_grads``: the DDP reduction over DP x CP, which with
``calculate_per_token_loss`` is a sum (gradient scaling factor 1), the TP all-reduce of norms under
sequence parallelism and of q/k norms, and the tied-embedding all-reduce across pipeline stages. So
``main_grad`` is the gradient of the mini-batch loss, independent of the micro-batch split and of the
DP / CP sizes. ``num_tokens`` is not passed (megatron would divide again).

The step (``optim.backend``; the mixin in ``trainer/actor_step.py``): ``local`` is AdamW on fp32 masters (``trainer.optimizer``), reading the fp32
``main_grad``, with the gradient norm, the clipping (the policy and a feature critic separately) and the
skip of non-finite steps in :meth:`Actor.optimizer_step`; ``megatron`` is ``get_megatron_optimizer``
(with the distributed optimizer when asked), its norm and clip, the same skip. Either way the learning
rates and weight decays come from megatron's ``OptimizerParamScheduler`` (``trainer/schedule.py``), which
reads each group's ``max_lr`` / ``min_lr`` / ``wd_mult``; its state is saved in checkpoints.
"""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import torch

from megatron_credit.models import actor_transformer_config, build_gpt_model, final_hidden_states, resolve_transformer_engine
from megatron_credit.trainer.actor_step import OptimizerStep
from megatron_credit.trainer.actor_weights import ActorWeights
from megatron_credit.trainer.schedule import build_scheduler, critic_schedule
from megatron_credit.batch.train_batch import MicroBatch

if TYPE_CHECKING:
    from megatron_credit.algorithm.capture import Capture
    from megatron_credit.recipe.config import ModelConfig, ParallelConfig
    from megatron_credit.recipe.moe import MoeConfig
    from megatron_credit.recipe.sections import OptimConfig

LossFn = Callable[[MicroBatch, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], dict],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(mb, logp [b, s], entropy [b, s] or None, values [b, s] or None, aux) -> (loss, stats)``; ``aux``: the
capture's outputs when :meth:`Actor.run` captures, else ``{}``. A separate critic
(``role="critic"``) passes ``logp = entropy = None``."""


def _has_safetensors(path: Optional[str]) -> bool:
    """Whether the weights come from a checkpoint (then megatron's random init, minutes per rank at 32B,
    is skipped; ``build_gpt_model`` sets the TP attributes init would have set)."""
    import os

    return bool(path) and any(f.endswith(".safetensors") for f in os.listdir(path))


class Actor(OptimizerStep, ActorWeights):
    """This rank's stage of the policy (and value head), its optimizer, and the schedules; with
    ``role="critic"``, of a separate value model (PPO's ``algorithm.params.critic: separate``)."""

    def __init__(self, *, hf_config, model: ModelConfig, parallel: ParallelConfig, optim: OptimConfig,
                 device: torch.device, with_critic: bool, with_reference: bool, seed: int,
                 temperature: float = 1.0, recompute: Optional[str] = None, logprob_chunk_size: int = 1024,
                 critic_factory: Optional[Callable[[], torch.nn.Module]] = None, critic_layers: int = 1,
                 capture: Optional[Capture] = None, role: str = "policy", packed_sequences: bool = False,
                 moe: Optional[MoeConfig] = None):
        """The recipe's ``model``, ``parallel`` and ``optim`` sections, and the few values of others the
        actor reads (``trainer.loop.actor_settings`` unpacks them): ``seed`` (a feature critic's
        initialisation), ``temperature`` (``rollout.temperature``: the log-probs are those of the sampling
        distribution), ``recompute`` and ``logprob_chunk_size`` (``train.*``), ``moe`` (the router losses of a
        mixture-of-experts model, ``recipe.moe``).

        ``critic_factory``: builds the value head of the last stage (default: a zero-initialised linear
        head on the actor's trunk, PPO). A factory's module (a feature critic) reads detached actor
        features: ``(layers, history, **side)``, the last ``critic_layers`` layers' outputs among them and
        the capture's outputs by name. ``capture`` (``algorithm/capture.py``): what the algorithm reads
        inside the behaviour pass's forward; the model is built with its ``model_options``.

        ``device``: this rank's device (``distributed.initialize`` returns it). The built model, the value
        head and the reference copy are moved there explicitly, as megatron's ``training.get_model`` does
        (``model_module.cuda(torch.cuda.current_device())``) after building: ``use_cpu_initialization``
        builds on the CPU, and even without it megatron 0.16's local spec leaves its norms there.

        ``packed_sequences`` (``train.packing``): the micro-batches are packed streams (THD, with
        megatron's ``PackedSeqParams``; ``batch/train_batch.py``), of different lengths under PP (megatron's
        ``variable_seq_lengths``: each send is preceded by its shape).

        ``role="critic"``: a value model (``trainer.critic_model.build_separate_critic`` builds it): the
        trunk and the default value head, no log-probs, the output layer frozen and unused, every group
        at ``optim.critic_lr``'s schedule."""
        if role not in ("policy", "critic"):
            raise ValueError(f"Actor role {role!r}: 'policy' or 'critic'")
        self.is_critic = role == "critic"
        assert not self.is_critic or (with_critic and not with_reference and critic_factory is None
                                      and capture is None), "a separate critic is a trunk + value head"
        from megatron.core import parallel_state as ps


        self.hf_config, self.optim, self.model_path = hf_config, optim, model.name_or_path
        self.temperature, self.logprob_chunk_size = temperature, logprob_chunk_size
        self.device = torch.device(device)
        self.ps = ps
        self.from_checkpoint = _has_safetensors(model.name_or_path)
        # per-token loss: the loss contract above; no random init for checkpoint weights
        te = resolve_transformer_engine(model.use_transformer_engine())  # the spec, and so the fused kernels
        self._te = te
        self.config = actor_transformer_config(hf_config, parallel=parallel, params_dtype=model.torch_dtype(),
                                               recompute=recompute, from_checkpoint=self.from_checkpoint,
                                               transformer_engine=te, moe=moe)
        self.packed_sequences = packed_sequences
        if packed_sequences and parallel.pipeline_model_parallel_size > 1:
            self.config.variable_seq_lengths = True  # packed micro-batches differ in length
        self.capture = capture
        self.model = build_gpt_model(hf_config, self.config, use_transformer_engine=te,
                                     packed_sequences=packed_sequences,
                                     unfused_norms=model.lora.enabled and not self.is_critic,  # LoRA reads normed input
                                     **(capture.model_options if capture is not None else {})).to(self.device)
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.lora = model.lora if model.lora.enabled and not self.is_critic else None
        if self.lora is not None:  # the base frozen, adapters on its linears (``models/lora.py``)
            from megatron_credit.models.lora import attach

            attach(self.model, rank=self.lora.rank, alpha=self.lora.scale_alpha, dropout=self.lora.dropout,
                   targets=self.lora.targets, seed=seed, layer_offset=self.layer_offset_of(ps, hf_config),
                   tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   tp_group=ps.get_tensor_model_parallel_group(), sequence_parallel=self.config.sequence_parallel)
        self.with_critic = with_critic
        self.feature_critic = critic_factory is not None  # reads detached features, clipped on its own
        self._layer_outputs: list = []
        self._collect = False
        self.last_critic_grad_norm: Optional[torch.Tensor] = None
        if with_critic and self.last_stage:
            self.model.value_head = self._value_head(critic_factory, seed=seed, critic_layers=critic_layers,
                                                     dtype=model.torch_dtype())
        if self.is_critic and self.last_stage:  # values come from the head: no vocabulary projection trains
            self.model.output_layer.weight.requires_grad_(False)
        from megatron_credit.distributed.grads import wrap_ddp

        o = optim
        self.megatron_optimizer = o.backend == "megatron"
        if self.megatron_optimizer and self.feature_critic:
            raise ValueError("optim.backend: megatron clips all parameters together, but this algorithm's critic "
                             "(on the actor's detached features) is clipped on its own: use optim.backend: local")
        # megatron DDP around the policy (and value head): fp32 gradient buffers, reduced in optimizer_step.
        self.ddp = wrap_ddp(self.model, use_distributed_optimizer=o.distributed_optimizer,
                            overlap_grad_reduce=o.overlap_grad_reduce, overlap_param_gather=o.overlap_param_gather)
        self.reference = None
        self.reference_from: Optional[str] = None  # see load_initial_weights
        # LoRA: the reference is the policy with its adapters off while the base is what the reference
        # should be (no second model held); reset_reference builds a copy once the adapters start elsewhere
        self.reference_off = with_reference and self.lora is not None
        if with_reference and self.lora is None:
            self.reference = build_gpt_model(hf_config, self.config, use_transformer_engine=te,
                                             packed_sequences=packed_sequences).to(self.device)
            self.reference.load_state_dict(self.model.state_dict(), strict=False)
            self.reference.requires_grad_(False).eval()
        self._read_process_groups(ps)
        self.router_monitor = None  # a mixture-of-experts model's router statistics (``trainer/moe.py``)
        if self.config.num_moe_experts:
            from megatron_credit.trainer.moe import RouterMonitor

            self.router_monitor = RouterMonitor(self.model, num_layers=self.config.num_layers,
                                                num_experts=self.config.num_moe_experts,
                                                pp_group=self.pp_group if self.pp_size > 1 else None,
                                                tp_group=self.tp_group if self.config.sequence_parallel else None,
                                                device=self.device)
        self.routing_replay = None  # the rollout engine's routing in the policy's routers (``trainer/moe.py``)
        if self.config.num_moe_experts and not self.is_critic:
            from megatron_credit.trainer.moe import RoutingReplay

            self.routing_replay = RoutingReplay(
                self.model, replay=moe is None or moe.routing_replay == "rollout", device=self.device,
                tp_size=self.tp_size, tp_rank=self.tp_rank, sequence_parallel=self.config.sequence_parallel,
                recompute=self.config.recompute_granularity == "full", tp_group=self.tp_group,
                pp_group=self.pp_group if self.pp_size > 1 else None)
        self.optimizer = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, o)
        # last_lr reports the policy's lr, or a separate critic's own
        self._report_max_lr = critic_schedule(o)["max_lr"] if self.is_critic else None
        self.last_lr = self.scheduler.get_lr({})  # the policy's lr of the last applied step (the next one until then)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (skipped ones do not count): the lr schedule's position."""
        return self.scheduler.num_steps

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self.scheduler.num_steps = int(value)

    # -- building ------------------------------------------------------------------------------------
    def _value_head(self, critic_factory, *, seed: int, critic_layers: int, dtype: torch.dtype) -> torch.nn.Module:
        """The last stage's value head on this rank's device: a factory's (a feature critic, reading the last
        ``critic_layers`` layers' outputs), or a zero-initialised linear head on the trunk (PPO)."""
        if critic_factory is not None:
            # Seeded on its own: the same critic whatever RNG draws this stage's layers consumed, so
            # every layout (and every TP rank) starts from the same critic.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                head = critic_factory()
            self._hook_layer_outputs(critic_layers - 1)
        else:
            head = torch.nn.Linear(self.hf_config.hidden_size, 1, dtype=dtype)
            torch.nn.init.zeros_(head.weight)  # zero-initialised: V = 0 until the critic learns
            torch.nn.init.zeros_(head.bias)
        return head.to(self.device)

    def _read_process_groups(self, ps) -> None:
        """This rank's megatron groups, sizes and ranks, read once (``ps``: megatron's parallel_state)."""
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.cp_group = ps.get_context_parallel_group()
        self.cp_size, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        self.tp_size, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()  # global rank of this pipeline's last stage
        self.dp_rank = ps.get_data_parallel_rank()
        self.ep_size, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group() if self.ep_size > 1 else None

    def _hook_layer_outputs(self, count: int) -> None:
        """Keep the outputs ``[s, b, H]`` (detached) of this stage's last ``count`` decoder layers before the
        final one, for a feature critic (the final layer's output reaches it after the final norm)."""
        layers = list(self.model.decoder.layers)[:-1][-count:] if count > 0 else []

        def keep(_module, _inputs, output):
            if self._collect:
                out = (output[0] if isinstance(output, tuple) else output).detach()
                if self.config.sequence_parallel:  # [s / tp, b, H] shards -> this CP rank's [s, b, H]
                    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                    out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
                self._layer_outputs.append(out)

        for layer in layers:
            layer.register_forward_hook(keep)

    def _build_optimizer(self, *, weight_decay: Optional[float] = None):
        """This model's optimizer for ``optim.backend`` (``trainer/optimizer_groups.py``); ``weight_decay``
        (default ``optim.weight_decay``): the supervised warm-up builds a second one without decay."""
        from megatron_credit.trainer.optimizer_groups import build_optimizer

        wd = self.optim.weight_decay if weight_decay is None else weight_decay
        return build_optimizer(self, weight_decay=wd)

    def build_optimizer(self, *, weight_decay: float):
        """Another optimizer of this actor's kind over the same parameters (the supervised warm-up's)."""
        return self._build_optimizer(weight_decay=weight_decay)

    @property
    def layer_offset(self) -> int:
        return self.layer_offset_of(self.ps, self.hf_config)

    @staticmethod
    def layer_offset_of(ps, hf_config) -> int:
        """The global index of this pipeline stage's first decoder layer."""
        return (ps.get_pipeline_model_parallel_rank() * hf_config.num_hidden_layers
                // ps.get_pipeline_model_parallel_world_size())

    def output_weight(self, model) -> torch.Tensor:
        """This TP rank's ``[V / tp, H]`` output projection (the shared embedding when tied)."""
        if model.share_embeddings_and_output_weights:
            return model.shared_embedding_or_output_weight()
        return model.output_layer.weight

    # -- schedules -----------------------------------------------------------------------------------
    def run(self, microbatches: Sequence[MicroBatch], loss_fn: LossFn, *, forward_only: bool,
            reference: bool = False, capture: bool = False, count_routing: bool = False
            ) -> list[dict[str, torch.Tensor]]:
        """Run ``microbatches`` through megatron's forward(-backward) schedule.

        ``loss_fn`` runs on the last stage per micro-batch (see the module docstring for the loss
        scale). Gradients accumulate into DDP's ``main_grad`` (call :meth:`optimizer_step` after a mini-batch).
        Returns the stats dict of each micro-batch on the last stage, ``[]`` elsewhere.
        Padded micro-batches must have one shape when PP > 1 (megatron communicates fixed shapes);
        packed ones go with megatron's ``PackedSeqParams``.
        ``capture`` (the behaviour pass): the actor's :class:`Capture` is armed before each forward and
        collected after it; ``loss_fn`` then gets its outputs as ``aux`` (whole rows ``[b, seq_len, ...]``,
        ``algorithm/capture.py``); else ``aux`` is {}.
        A mixture of experts' policy replays each micro-batch's ``routed_experts`` (``moe.routing_replay``);
        ``count_routing`` (the behaviour pass) counts how often its own routers agree with them.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        off = reference and self.reference_off  # LoRA: the reference is this model with its adapters off
        model = self.reference if reference and not off else self.model
        runner = model if reference and not off else self.ddp  # gradients go to DDP's buffers
        if self.pp_size > 1 and not self.config.variable_seq_lengths:
            shapes = {(mb.num_rows, mb.seq_len) for mb in microbatches}
            assert len(shapes) == 1, f"PP needs one micro-batch shape, got {shapes}"
        sp = self.config.sequence_parallel
        temperature, chunk = self.temperature, self.logprob_chunk_size
        replay = self.routing_replay if not reference else None
        if replay is not None:
            replay.start(count=count_routing, training=not forward_only)

        def loss_func(mb: MicroBatch, hidden: torch.Tensor):
            from megatron_credit.losses.logprob import logprobs_from_hidden

            if sp:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            h = hidden.transpose(0, 1)  # [b, s, H]
            logp = ent = None
            if not self.is_critic:
                logp, ent = logprobs_from_hidden(h, self.output_weight(model), mb.tensors["labels"],
                                                 tp_group=self.tp_group if self.tp_size > 1 else None,
                                                 chunk_size=chunk, temperature=temperature)
            aux = self.capture.collect(mb) if capture else {}
            values = None
            if self.with_critic and not reference:
                values = self._values(model.value_head, mb, h, aux)
            loss, stats = loss_fn(mb, logp, ent, values, aux)
            num_tokens = mb.tensors["loss_mask"].sum().to(torch.int)
            return loss, num_tokens, stats

        def forward_step(data_iterator: Iterator[MicroBatch], model_chunk):
            mb = next(data_iterator)
            model_chunk = getattr(model_chunk, "module", model_chunk)  # the GPTModel inside DDP
            if capture and self.last_stage:
                self.capture.arm(model_chunk, mb)
            self._collect = self.feature_critic and self.last_stage and not reference
            self._layer_outputs = []
            if replay is not None:
                replay.set_microbatch(mb.tensors.get("routed_experts"))
            try:
                with final_hidden_states(model_chunk) if self.last_stage else contextlib.nullcontext():
                    packed = {"packed_seq_params": mb.packed_seq_params} if mb.packed else {}
                    out = model_chunk(mb.tensors["input_ids"], mb.position_ids, None, **packed)
            finally:
                self._collect = False
            return out, functools.partial(loss_func, mb)  # megatron calls it right after, on the last stage

        first = microbatches[0]
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        runner.train(not forward_only)
        base = contextlib.nullcontext()
        if off:
            from megatron_credit.models.lora import adapters_off

            base = adapters_off(self.model)
        with grad_ctx, base, self._aux_loss_scale(microbatches, forward_only):
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(microbatches), model=[runner],
                num_microbatches=len(microbatches),
                # The global length: megatron's get_tensor_shapes divides it by CP (and TP with SP).
                seq_length=first.seq_len, micro_batch_size=first.num_rows, forward_only=forward_only)
        if replay is not None:
            replay.start(count=False, training=False)  # nothing outlives the schedule
        return list(out) if self.last_stage else []

    def _aux_loss_scale(self, microbatches: Sequence[MicroBatch], forward_only: bool):
        """A training pass of a mixture-of-experts model weighs megatron's router losses by ``1 / N``, N the
        router tokens of these micro-batches over DP x CP (``trainer/moe.aux_loss_scale``)."""
        if forward_only or not self.config.num_moe_experts:
            return contextlib.nullcontext()
        import torch.distributed as dist

        from megatron_credit.trainer.moe import aux_loss_scale

        tokens = torch.tensor([float(sum(mb.num_rows * mb.seq_len // self.cp_size for mb in microbatches))],
                              dtype=torch.float64, device=self.device)
        if dist.get_world_size(self.dp_cp_group) > 1:
            dist.all_reduce(tokens, group=self.dp_cp_group)
        return aux_loss_scale(1.0 / tokens.clamp(min=1).reshape(()))  # on the device: no read before the schedule

    # -- model statistics ------------------------------------------------------------------------------
    @property
    def metric_tables(self) -> tuple:
        """The metric tables of what :meth:`model_statistics` returns (a dense model: none)."""
        from megatron_credit.trainer.moe import MOE

        return (MOE,) if self.router_monitor is not None else ()

    def reset_model_statistics(self) -> None:
        """Forget what the model's own statistics gathered so far (before an iteration's update)."""
        if self.router_monitor is not None:
            self.router_monitor.statistics(self.device, reduce=False)

    def model_statistics(self) -> dict[str, torch.Tensor]:
        """The model's own ``sum:`` statistics of the training forwards since the last call (a mixture of
        experts: its routers'), equal on every pipeline stage; collective over PP. Resets them."""
        out = self.router_monitor.statistics(self.device) if self.router_monitor is not None else {}
        if self.routing_replay is not None:
            out.update(self.routing_replay.statistics(self.device))
        return out

    # -- the value head ------------------------------------------------------------------------------
    def _values(self, head, mb: MicroBatch, h: torch.Tensor, aux: dict) -> torch.Tensor:
        """``[b, s]`` values of this rank's tokens: the PPO head on the trunk, or a feature critic on
        detached features and the capture's outputs (from ``aux`` in the behaviour pass, from the
        micro-batch's side channel in the update; None without either)."""
        if not self.feature_critic:
            return head(h).squeeze(-1).float()
        from megatron_credit.batch.context_parallel import gather_from_cp, split_for_cp

        cp = self.cp_group if self.cp_size > 1 else None
        names = self.capture.critic_inputs if self.capture is not None else ()
        if aux:
            cut = (lambda x: mb.packing.pack(x)) if mb.packed else \
                (lambda x: split_for_cp(x, cp_size=self.cp_size, cp_rank=self.cp_rank))
            local = {k: cut(aux[k]) for k in names if k in aux}
        elif names and all(k in mb.tensors for k in names):
            local = {k: mb.tensors[k] for k in names}
        else:  # no behaviour pass behind this micro-batch (the supervised warm-up): no values
            return None
        layers = [x.transpose(0, 1) for x in self._layer_outputs] + [h.detach()]
        if mb.packed:  # one sequence per row (its top-K keys are positions in its own sequence)
            rows = mb.packing
            values = head([mb.rows_view(x) for x in layers], rows.whole_rows(h.detach(), cp_group=cp),
                          **{k: mb.rows_view(v) for k, v in local.items()})
            return rows.from_rows(values).float()
        history = gather_from_cp(h.detach(), cp_group=cp) if cp is not None else h.detach()
        return head(layers, history, **local).float()
