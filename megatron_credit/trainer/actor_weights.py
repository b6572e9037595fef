"""The actor's weights: the HF weights it starts from, the engine's weights it sends (merged with LoRA's
adapters when it has them), and the KL reference policy (a frozen copy, or LoRA's adapters off).

:class:`ActorWeights` is a mixin of :class:`megatron_credit.trainer.actor.Actor`, which builds what it reads:
``model``, ``ddp``, ``optimizer``, ``reference`` / ``reference_off``, ``lora``, ``hf_config``, ``config``,
``model_path``, ``from_checkpoint`` and the TP / PP / EP groups, sizes and ranks. One job here, building and
running the model there.
"""
from __future__ import annotations

import torch

from megatron_credit.models import build_gpt_model
from megatron_credit.trainer.optimizer import MasterWeightsAdamW


class ActorWeights:
    """Weights in, weights out, and the reference (see the module docstring)."""

    @property
    def has_reference(self) -> bool:
        """Whether the run keeps a KL reference (a frozen copy, or with LoRA the adapters off)."""
        return self.reference is not None or self.reference_off

    def load_initial_weights(self, *, seed: int) -> str:
        """Fill this rank's shard from HF weights: the safetensors of ``model.name_or_path`` when it has
        them, else a ``transformers`` random init seeded with ``seed``. Either way every layout starts
        from the same full model (megatron's own init draws each pipeline stage's layers from a
        different point of the RNG stream). Returns where the weights came from."""
        from megatron_credit.conversion import family_for_config, load_hf_into_local_state

        path = self.model_path
        if self.from_checkpoint:
            from megatron_credit.conversion.hf_io import SafetensorsReader

            get, source = SafetensorsReader(path).get, f"HF weights of {path}"
        else:
            from transformers import AutoModelForCausalLM

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                hf_model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
            from megatron_credit.conversion.testing import checkpoint_state

            state = checkpoint_state(hf_model.state_dict())  # routed experts under the checkpoint's names
            get, source = state.__getitem__, f"random initialisation (seed {seed})"
        local = {k: v for k, v in self._base_state(keep_vars=True).items() if not k.startswith("value_head.")}
        load_hf_into_local_state(local, get, family_for_config(self.hf_config), self.hf_config,
                                 tp_rank=self.tp_rank, tp_size=self.tp_size, layer_offset=self.layer_offset,
                                 ep_rank=self.ep_rank, ep_size=self.ep_size)
        self.sync_optimizer_from_model()
        self.reset_reference()
        # a reference that is these HF weights is saved as their path (trainer/checkpoint.reference_extras)
        self.reference_from = path if self.from_checkpoint and self.reference is not None else None
        return source

    def gather_params(self) -> None:
        """Make this rank's parameters current before they are read outside a forward pass (with
        ``optim.overlap_param_gather`` the last step's all-gather is otherwise left to the next forward)."""
        from megatron_credit.distributed.grads import gather_params

        gather_params(self.ddp)

    def sync_optimizer_from_model(self) -> None:
        """The optimizer's fp32 copies := the model's weights (after weights are loaded into the model)."""
        if not isinstance(self.optimizer, MasterWeightsAdamW):
            self.optimizer.reload_model_params()
        else:
            self.optimizer.sync_masters_from_model()

    # -- weights out -----------------------------------------------------------------------------------
    def hf_weight_buckets(self, bucket_bytes: int = 1 << 28):
        """The policy's weights as HF-named full tensors in buckets (collective over TP and PP)."""
        from megatron_credit.conversion import family_for_config, iter_hf_weight_buckets

        self.gather_params()
        if self.lora is not None:  # W + B A * alpha / rank, one weight at a time
            from megatron_credit.models.lora import MergedState

            state = MergedState(self.model, skip="value_head.")  # a mapping: merged when read, not all at once
        else:
            state = {k: v for k, v in self.model.state_dict().items() if not k.startswith("value_head.")}
        return iter_hf_weight_buckets(state, family_for_config(self.hf_config), self.hf_config,
                                      tp_group=self.tp_group if self.tp_size > 1 else None,
                                      pp_group=self.pp_group if self.pp_size > 1 else None,
                                      ep_group=self.ep_group, layer_offset=self.layer_offset,
                                      bucket_bytes=bucket_bytes)

    def reference_copy(self) -> torch.nn.Module:
        """A LoRA run's reference as a model of its own (the adapters off no longer give it), built once."""
        self.reference_off = False
        if self.reference is None:
            self.reference = build_gpt_model(self.hf_config, self.config, use_transformer_engine=self._te,
                                             packed_sequences=self.packed_sequences,
                                             unfused_norms=True).to(self.device)  # the policy's own spec
            self.reference.requires_grad_(False).eval()
        return self.reference

    def _base_state(self, *, keep_vars: bool = False) -> dict:
        """The model's state dict without LoRA adapters."""
        from megatron_credit.models.lora import base_state

        return base_state(self.model, keep_vars=keep_vars)

    def reset_reference(self) -> None:
        """The frozen reference := the current policy (after a warm-up or an initial load). With LoRA, while
        every adapter is still zero (``B = 0``) the policy is its base and the reference stays the adapters
        off; adapters trained before RL (a warm-up) make it a copy of the merged weights."""
        self.reference_from = None  # no longer (known to be) the HF weights of model.name_or_path
        if self.lora is not None and (self.reference_off or self.reference is not None):
            from megatron_credit.models.lora import MergedState, adapters

            found = [a.b.detach().abs().amax() for _, a in adapters(self.model)]
            if not found or float(torch.stack(found).amax()) == 0.0:  # one host read
                self.reference, self.reference_off = None, True
                return
            self.gather_params()
            merged, into = MergedState(self.model, skip="value_head."), self.reference_copy().state_dict()
            with torch.no_grad():
                for k in merged:  # one merged weight alive at a time
                    if isinstance(into.get(k), torch.Tensor):  # (TE's _extra_state entries carry no weights)
                        into[k].copy_(merged[k])
            return
        if self.reference is not None:
            self.gather_params()
            state = {k: v for k, v in self.model.state_dict().items() if not k.startswith("value_head.")}
            self.reference.load_state_dict(state, strict=False)
