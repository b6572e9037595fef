"""The `transformers` rollout engine: our own sampling loop over a HF causal LM with a KV cache.

The default engine on machines without CUDA, and the GPU fallback when vLLM is absent. We call the
model's forward ourselves instead of ``model.generate`` so that we control, and test, exactly what
is sampled and which log-probs are returned:

- prompts are left-padded into one batch with an attention mask and explicit position ids
  (``cumsum(mask) - 1``), so a padded row computes the same numbers as the prompt alone;
- the prompt is pre-filled once per prompt and the KV cache is then repeated n times
  (``DynamicCache.batch_repeat_interleave``) instead of pre-filling n identical rows;
- each sample has its own ``torch.Generator`` seeded from (seed, group id, sample index), so a
  sample is reproducible and independent of which other prompts share the batch (``seed_mode:
  per_sample``, this engine's default); ``per_call`` draws every row's noise from one generator per call;
- per-row stop handling: a row that sampled a stop token or ran out of budget is finished; finished
  rows are dropped from the batch and the KV cache (``batch_select_indices``) once they are a quarter
  of it, and until then are fed along with the rest and ignored;
- log-probs are "raw" (full-vocabulary ``log_softmax(logits / T)``, what the trainer recomputes) or
  "processed" (after top-k/top-p renormalisation), per ``SamplingParams.logprobs_mode``.
- a mixture-of-experts model's routing is recorded (:class:`RoutingRecorder`, forward hooks on its routers):
  each sample carries the experts every token was sent to, for the trainer to replay (``moe.routing_replay``).

Weights arrive from the megatron actor as HF-named tensor buckets and are copied in place
(:mod:`megatron_credit.rollout.weight_sync`).
"""
from __future__ import annotations

import inspect
import secrets
import time
from typing import Any, Sequence

import torch

from megatron_credit.rollout.engine import ROLLOUT_ENGINES, WeightBuckets, empty_cache, resolve_group_ids
from megatron_credit.rollout.sampling import (ExponentialNoise, call_seed, noise_block_steps, resolve_seed_mode,
                                              row_seed, sample_step)
from megatron_credit.rollout.types import FinishStatus, RolloutBatch, RolloutSample, SamplingParams, SampleTimings
from megatron_credit.rollout.weight_sync import load_named_tensor_buckets


@ROLLOUT_ENGINES.register("hf")
class HFRolloutEngine:
    """Rollout engine over a ``transformers`` causal LM (CPU or CUDA).

    Give exactly one of ``model`` (a built ``PreTrainedModel``), ``hf_config`` (a ``PretrainedConfig``
    or its dict; weights are random until ``update_weights``) or ``model_path`` (a local HF directory).
    ``max_batch_size`` bounds the rows (prompts x n) decoded together; None decodes all at once.
    ``compact_finished`` drops finished rows from the batch and the KV cache as decoding goes on.
    ``seed_mode`` (``rollout.seed_mode``; ``auto``: :attr:`DEFAULT_SEED_MODE`): ``per_sample`` or ``per_call``.
    """

    DEFAULT_SEED_MODE = "per_sample"
    """Each row's noise is drawn in one call per block of steps anyway: per-sample seeds cost this engine
    nothing, and they give the same samples for any engine count."""

    def __init__(
        self,
        *,
        model: Any = None,
        hf_config: Any = None,
        model_path: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        max_batch_size: int | None = None,
        compact_finished: bool = True,
        init_seed: int = 0,
        sleep_level: int = 1,
        seed_mode: str = "per_sample",
    ):
        if sum(x is not None for x in (model, hf_config, model_path)) != 1:
            raise ValueError("give exactly one of model, hf_config, model_path")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.seed_mode = resolve_seed_mode(seed_mode, engine_default=self.DEFAULT_SEED_MODE)
        self.sleep_level = sleep_level
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.compact_finished = compact_finished
        self.between_steps = None
        """A callable run between decode steps (None: none). It may load new weights in place and then
        returns True: the responses in flight go on under the new weights, their prefixes (prompt and the
        tokens sampled so far) computed again with them (a partial rollout); each token's log-prob is that
        of the weights that sampled it."""
        if model is None:
            model = _build_model(hf_config, model_path, dtype, attn_implementation, init_seed)
        self._model = model.to(device=self.device).eval()
        # What sleep() released, until wake_up() brings it back: "weights" and "kv_cache" (vLLM's tags).
        self._asleep: set[str] = set()
        self._weights_valid = True  # False after a level-2 sleep, until a sync
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
        # transformers 5.x renamed the KV-cache argument `past_key_values` -> `cache` (the old name is
        # deprecated); older releases only know the old one.
        params = inspect.signature(self._model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._routing = RoutingRecorder.attach(self._model)  # None for a dense model

    @property
    def model(self) -> Any:
        """The live HF model (for tests and teacher-forced checks)."""
        if self._model is None:
            raise RuntimeError("the engine is closed")
        return self._model

    # -- generation ---------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, group_ids: Sequence[int] | None = None
    ) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt; see :class:`RolloutEngine`."""
        if self._asleep:
            raise RuntimeError("the engine is asleep: call wake_up() before generate()")
        if not self._weights_valid:
            raise RuntimeError("the engine dropped its weights (sleep level 2): update_weights first")
        gids = resolve_group_ids(len(prompts), group_ids)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        if not prompts:
            return RolloutBatch(samples=[], wall_s=0.0)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        start = time.perf_counter()
        prompts_per_chunk = len(prompts) if self.max_batch_size is None else max(1, self.max_batch_size // params.n)
        # per_call: one generator for the whole call, its chunks drawn from it in order
        shared = torch.Generator(device=self.device).manual_seed(call_seed(seed, gids[0])) \
            if self.seed_mode == "per_call" else None
        samples: list[RolloutSample] = []
        with torch.inference_mode():
            for lo in range(0, len(prompts), prompts_per_chunk):
                hi = lo + prompts_per_chunk
                samples += self._generate_chunk(prompts[lo:hi], gids[lo:hi], params, seed, start, shared)
        return RolloutBatch(samples=samples, wall_s=time.perf_counter() - start)

    def _budgets(self, prompts: list[list[int]], params: SamplingParams) -> list[int]:
        """New-token budget of each prompt: max_new_tokens, capped by the model's context length."""
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        if max_pos is None:
            return [params.max_new_tokens] * len(prompts)
        return [min(params.max_new_tokens, max_pos - len(p)) for p in prompts]

    def _generate_chunk(
        self, prompts: list[list[int]], gids: list[int], params: SamplingParams, seed: int, start: float,
        shared: torch.Generator | None = None,
    ) -> list[RolloutSample]:
        budgets = self._budgets(prompts, params)
        ok = [i for i, b in enumerate(budgets) if b > 0]
        decoded = self._decode([prompts[i] for i in ok], [gids[i] for i in ok], [budgets[i] for i in ok],
                               params, seed, start, shared) if ok else []
        by_prompt = dict(zip(ok, decoded))
        out: list[RolloutSample] = []
        for i, prompt in enumerate(prompts):
            if i in by_prompt:
                out += by_prompt[i]
                continue
            max_pos = self.model.config.max_position_embeddings
            out += [
                RolloutSample(prompt_ids=list(prompt), response_ids=[], logprobs=torch.zeros(0),
                              status=FinishStatus.FAILED, group_id=gids[i], sample_index=j,
                              logprobs_mode=params.logprobs_mode,
                              error=f"prompt of {len(prompt)} tokens leaves no room in the model context "
                                    f"({max_pos} positions)")
                for j in range(params.n)
            ]
        return out

    def _prefill(self, prompts: list[list[int]], n: int
                 ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-pad, run the prompts once, repeat each row n times.

        Returns (last logits [P*n, V] float32, KV cache with P*n rows, attention mask [P*n, L] int64,
        next position [P*n] int64, the left-padded prompt ids [P*n, L] int64).
        """
        longest = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), longest), dtype=torch.long)  # pad id is irrelevant: masked out
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, longest - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Positions count real tokens only, so a left-padded row sees the same positions as its prompt alone.
        pos = (mask.cumsum(dim=-1) - 1).clamp_min(0)
        logits, cache = self._forward(ids, mask, pos, None)
        if n > 1:
            cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        return (logits, cache, mask.repeat_interleave(n, dim=0), (pos[:, -1] + 1).repeat_interleave(n, dim=0),
                ids.repeat_interleave(n, dim=0))

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
                 ) -> tuple[torch.Tensor, Any]:
        """One model call: ids [R, S], mask [R, L + S], pos [R, S] -> (last logits [R, V] float32, cache)."""
        kwargs = {} if cache is None else {self._cache_kw: cache}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **kwargs)
        cache = out.cache if self._cache_kw == "cache" else out.past_key_values
        return out.logits[:, -1].float(), cache

    def _decode(
        self, prompts: list[list[int]], gids: list[int], budgets: list[int], params: SamplingParams,
        seed: int, start: float, shared: torch.Generator | None = None,
    ) -> list[list[RolloutSample]]:
        """Sample all rows of one chunk to completion; returns the samples of each prompt. ``shared``: the
        call's one generator (``per_call``), else each row's own from ``seed``.

        Per-row state (``status``, ``length``, ``done``...) is indexed by row r = prompt * n + sample;
        the model batch holds only the ``live`` rows, which shrinks when enough rows have finished.
        A decode step reads the device once (which live rows go on, after the step's tokens are sampled):
        on a GPU each read waits for the queued kernels (tests/rollout/test_hf_decode_syncs.py counts them).
        """
        n, rows, steps = params.n, len(prompts) * params.n, max(budgets)
        logits, cache, prompt_mask, next_pos, prompt_ids = self._prefill(prompts, n)
        first_token_s = time.perf_counter() - start
        # The mask grows by one column per step: allocate it once (finished rows keep attending; ignored).
        prompt_len = prompt_mask.shape[1]
        routes = None  # [rows, prompt_len + steps, layers, top_k]: each position's experts (left-padded prompt)
        if self._routing is not None:
            routes = self._routing.buffer(rows, prompt_len + steps, device=self.device)
            routes[:, :prompt_len] = self._routing.take(len(prompts), prompt_len).repeat_interleave(n, dim=0)
        mask = torch.ones((rows, prompt_len + steps), dtype=torch.long, device=self.device)
        mask[:, :prompt_len] = prompt_mask
        vocab = logits.shape[-1]
        block = noise_block_steps(params, vocab)
        if shared is not None:
            noise = ExponentialNoise.shared(shared, rows=rows, vocab=vocab, block_steps=block, device=self.device)
        else:
            gens = [torch.Generator(device=self.device).manual_seed(row_seed(seed, gids[r // n], r % n))
                    for r in range(rows)]
            noise = ExponentialNoise(gens, vocab=vocab, block_steps=block, device=self.device)
        dev = self.device
        budget = torch.tensor(budgets, device=dev).repeat_interleave(n)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=dev)
        status = torch.full((rows,), int(FinishStatus.TRUNCATED), dtype=torch.long, device=dev)
        length = torch.zeros(rows, dtype=torch.long, device=dev)
        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        finish_step = torch.zeros(rows, dtype=torch.long, device=dev)
        tokens = torch.zeros((rows, steps), dtype=torch.long, device=dev)
        logps = torch.zeros((rows, steps), dtype=torch.float32, device=dev)
        live = torch.arange(rows, device=dev)
        step_end_s = []
        for step in range(steps):
            tok, raw, processed = sample_step(logits, params=params, noise=None if params.greedy else noise.next())
            tokens[live, step] = tok
            logps[live, step] = raw if params.logprobs_mode == "raw" else processed
            # The live rows' state, updated on the device with no read back: torch.where, not boolean indexing.
            active = ~done[live]
            bad = active & ~torch.isfinite(logits).all(dim=-1)
            grown = length[live] + (active & ~bad).long()
            length[live] = grown
            stopped = active & ~bad & torch.isin(tok, stop_ids)
            ended = stopped | bad | (active & (grown >= budget[live]))
            status[live] = torch.where(stopped, int(FinishStatus.STOPPED),
                                       torch.where(bad, int(FinishStatus.FAILED), status[live]))
            finish_step[live] = torch.where(ended, step, finish_step[live])
            alive = active & ~ended
            done[live] = ~alive
            # The step's one read of the device: which live rows go on. It decides the stop and the compaction.
            kept = [i for i, a in enumerate(alive.tolist()) if a]
            step_end_s.append(time.perf_counter() - start)
            if not kept:
                break
            if self.compact_finished and len(kept) <= 0.75 * len(live):
                # Drop finished rows from the batch (and the KV cache) once a quarter of it is dead weight.
                # nonzero_static: the count is known on the host, so the indices need no second read.
                keep = torch.nonzero_static(alive, size=len(kept)).squeeze(-1)
                live, tok, next_pos, logits = live[keep], tok[keep], next_pos[keep], None
                cache.batch_select_indices(keep)
                noise.select(keep, kept)
            if self.between_steps is not None and self.between_steps():  # new weights: the prefixes again
                prefix = torch.cat([prompt_ids[live], tokens[live, : step + 1]], dim=1)
                prefix_mask = mask[live, : prompt_len + step + 1]
                logits, cache = self._forward(prefix, prefix_mask, (prefix_mask.cumsum(-1) - 1).clamp_min(0), None)
                if routes is not None:  # the prefixes' routing under the new weights
                    routes[live, : prompt_len + step + 1] = self._routing.take(len(live), prompt_len + step + 1)
            else:
                logits, cache = self._forward(tok.unsqueeze(-1), mask[live, : prompt_len + step + 1],
                                              next_pos.unsqueeze(-1), cache)
                if routes is not None:
                    routes[live, prompt_len + step] = self._routing.take(len(live), 1)[:, 0]
            next_pos = next_pos + 1
        return self._to_samples(prompts, gids, params, tokens, logps, length, status, finish_step, first_token_s,
                                step_end_s, routes)

    @staticmethod
    def _to_samples(prompts, gids, params, tokens, logps, length, status, finish_step, first_token_s, step_end_s,
                    routes=None):
        """Per-row tensors (tokens, logps [rows, steps]; length, status, finish_step [rows]; ``routes``: each
        left-padded position's experts ``[rows, prompt_len + steps, layers, top_k]`` or None) -> samples per
        prompt. A sample's last token never went through the model: its routing is -1, whether or not the
        row was still fed (which depends on the other rows of the batch)."""
        n = params.n
        tokens, logps = tokens.cpu(), logps.float().cpu()
        length, status, finish_step = length.tolist(), status.tolist(), finish_step.tolist()
        routes = routes.cpu() if routes is not None else None
        prompt_len = routes.shape[1] - tokens.shape[1] if routes is not None else 0
        out: list[list[RolloutSample]] = [[] for _ in prompts]
        for r in range(len(prompts) * n):
            st = FinishStatus(status[r])
            routed = None
            if routes is not None:
                p = len(prompts[r // n])
                routed = routes[r, prompt_len - p: prompt_len + length[r]].clone()
                routed[-1] = -1
            out[r // n].append(RolloutSample(
                prompt_ids=list(prompts[r // n]),
                response_ids=tokens[r, : length[r]].tolist(),
                logprobs=logps[r, : length[r]].clone(),
                status=st, group_id=gids[r // n], sample_index=r % n, logprobs_mode=params.logprobs_mode,
                timings=SampleTimings(first_token_s=first_token_s, finish_s=step_end_s[finish_step[r]]),
                error=f"non-finite logits after {length[r]} tokens" if st == FinishStatus.FAILED else "",
                routed_experts=routed,
            ))
        return out

    # -- weights and memory -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, rollout, model, *, seed: int, hf_config, device, gpus=None) -> "HFRolloutEngine":
        """The trainer's engine for the recipe's ``rollout`` and ``model`` sections: ``hf_config`` (weights
        come by sync), on ``device`` (the actor's: this rank's GPU when it has one), in the actor's dtype
        (``model.dtype``), ``rollout.max_batch_size``; ``rollout.engine_options`` override. ``seed`` is not
        used (sampling seeds come with each request). ``gpus``: the devices the engine owns
        (``rollout.placement``); the model is one full copy on the first, the building rank's ``device``
        (``engine_options.tensor_parallel_size`` only sets how many ranks share one engine). The trainer
        syncs every parameter after waking the weights, so on an accelerator the engine sleeps at level 2
        (weights dropped, not copied to the host)."""
        opts = dict(rollout.engine_options or {})
        opts.pop("tensor_parallel_size", None)
        kwargs = {"hf_config": hf_config, "device": device, "dtype": model.torch_dtype(),
                  "max_batch_size": rollout.max_batch_size, "sleep_level": 2, "seed_mode": rollout.seed_mode, **opts}
        return cls(**kwargs)

    def update_weights(self, buckets: WeightBuckets, *, strict: bool = True) -> int:
        """Copy HF-named tensors into the model in place; returns how many tensors were copied.

        Unknown names and shape mismatches raise ValueError naming the tensor; with ``strict``, so does
        a stream that leaves a parameter uncovered. Refused while the weights sleep: the colocated order is
        ``wake_up(["weights"])``, sync, ``wake_up(["kv_cache"])``, generate, ``sleep()``.
        """
        if "weights" in self._asleep:
            raise RuntimeError("the engine's weights are asleep: call wake_up(['weights']) before update_weights()")
        count = load_named_tensor_buckets(self.model, buckets, strict=strict)
        self._weights_valid = self._weights_valid or strict
        return count

    def _unique_params(self) -> list[torch.nn.Parameter]:
        return list({id(p): p for p in self.model.parameters()}.values())

    def sleep(self) -> None:
        """On an accelerator, release the weights (level 1: to host memory; level 2: dropped, a sync must
        follow) and the allocator's cache; on the CPU nothing is freed (only the state is tracked)."""
        if self._asleep:
            return
        if self.device.type != "cpu":
            if self.sleep_level == 1:
                self.model.to("cpu")
            else:  # tied parameters are one Parameter: each is released once
                for p in self._unique_params():
                    self._shapes[id(p)] = (p.shape, p.dtype)
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                self._weights_valid = False
            empty_cache(self.device)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what :meth:`sleep` released: ``tags`` ("weights", "kv_cache"), all by default. After a
        level-2 sleep the weights come back uninitialised, for :meth:`update_weights` to fill."""
        wanted = _wake_tags(tags)
        if "weights" in wanted and "weights" in self._asleep and self.device.type != "cpu":
            if self.sleep_level == 1:
                self.model.to(self.device)
            else:
                for p in self._unique_params():
                    shape, dtype = self._shapes.pop(id(p))
                    p.data = torch.empty(shape, dtype=dtype, device=self.device)
        self._asleep -= wanted

    def close(self) -> None:
        self._model = None
        empty_cache(self.device)


class RoutingRecorder:
    """The experts a HF mixture-of-experts model sends each token to, per MoE layer: forward hooks on its
    routers (Qwen3-MoE's ``mlp.gate``: a ``TopKRouter`` returning ``(logits, weights, indices)`` in
    transformers 5, a linear layer returning the logits in 4.x, whose top-k of the softmax we take as the
    block does). :meth:`take` returns what the last forward routed."""

    def __init__(self, gates: list, top_k: int) -> None:
        self.top_k = top_k
        self._last: list = [None] * len(gates)
        for i, gate in enumerate(gates):
            gate.register_forward_hook(self._hook(i))

    @classmethod
    def attach(cls, model) -> "RoutingRecorder | None":
        """A recorder on ``model``'s routers, in layer order; None when it has none (a dense model)."""
        top_k = getattr(model.config, "num_experts_per_tok", None)
        gates = [m.mlp.gate for m in _decoder_layers(model) if hasattr(getattr(m, "mlp", None), "experts")]
        return cls(gates, int(top_k)) if gates and top_k else None

    def _hook(self, i: int):
        def keep(_module, _inputs, output) -> None:
            if isinstance(output, tuple):
                self._last[i] = output[2]
            else:
                self._last[i] = torch.topk(torch.softmax(output.float(), dim=-1), self.top_k, dim=-1).indices
        return keep

    def buffer(self, rows: int, positions: int, *, device: torch.device) -> torch.Tensor:
        """``[rows, positions, layers, top_k]`` int16 on ``device``, filled with -1 (no routing)."""
        return torch.full((rows, positions, len(self._last), self.top_k), -1, dtype=torch.int16, device=device)

    def take(self, rows: int, positions: int) -> torch.Tensor:
        """The last forward's experts as ``[rows, positions, layers, top_k]`` int16 (its input was
        ``[rows, positions]``: the routers see the tokens row by row)."""
        if any(x is None for x in self._last):
            raise RuntimeError("a router of the model did not run in the last forward")
        out = torch.stack([x.reshape(rows, positions, self.top_k) for x in self._last], dim=2)
        self._last = [None] * len(self._last)
        return out.to(torch.int16)  # on the model's device: no host sync per decode step


def _decoder_layers(model) -> list:
    """The decoder layers of a HF causal LM (``model.model.layers``), [] when it has none there."""
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers", []) or [])


def _wake_tags(tags: Sequence[str] | None) -> set[str]:
    """The parts to wake: ``tags`` checked against vLLM's two ("weights", "kv_cache"); None: both."""
    wanted = {"weights", "kv_cache"} if tags is None else set(tags)
    if not wanted or wanted - {"weights", "kv_cache"}:
        raise ValueError(f"wake_up tags must be among ('weights', 'kv_cache'), got {tags!r}")
    return wanted



def _build_model(hf_config: Any, model_path: str | None, dtype: torch.dtype, attn_implementation: str, init_seed: int):
    """A HF causal LM from a config (random init, seeded) or a local directory."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: only when an engine is built

    if model_path is not None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn_implementation)
    if isinstance(hf_config, dict):
        cfg = dict(hf_config)
        hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    # Seed the initialisation locally, without touching the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
