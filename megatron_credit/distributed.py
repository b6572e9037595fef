"""torch.distributed + megatron ``parallel_state`` initialisation, seeds, and the CPU shims.

``initialize(parallel, seed=..., launch=...)`` is called once per process by the entry point: it joins
(or creates) the default process group — nccl on GPU, gloo on CPU — builds megatron's TP / PP / CP /
DP groups and seeds every generator. The launcher's environment (torchrun's ``RANK`` etc.) is read by
``LaunchEnv.from_environ`` at the entry point only and passed in.

CPU shims. megatron-core assumes CUDA in a few places that the CPU tests and the demo reach.
All work-arounds live in ``install_cpu_shims`` below, each naming the megatron-core line it works
around, and are installed only when the backend is gloo on a machine without CUDA. Their targets were
checked in 0.16.1, 0.17.1, 0.18.2 and 0.19.2 (the CPU tests pass on each); ``cpu_shim_problems``
re-checks them at install time, so a release that moves one fails loudly instead of silently not
patching:

1. RNG tracker: ``tensor_parallel/random.py`` ``CudaRNGStatesTracker.add/fork`` call
   ``torch.cuda.get_rng_state`` (so ``model_parallel_cuda_manual_seed`` fails); a generator-based
   ``CpuRNGStatesTracker`` with the same seeds and interface replaces it.
2. Device requests: ``torch.cuda.current_device()`` in ``models/common/embeddings/
   rotary_pos_embedding.py`` (``inv_freq`` / ``get_freqs_non_repeated``), ``pipeline_parallel/
   p2p_communication.py`` (``_communicate_shapes`` / ``_communicate`` receive buffers),
   ``tensor_parallel/mappings.py`` (gather buffers), ``tensor_parallel/layers.py`` and ``utils.py``
   (``GlobalMemoryBuffer.get_tensor``, used by ``DotProductAttention`` for its score buffer); and
   ``device="cuda"`` in ``pipeline_parallel/schedules.py`` (``total_num_tokens``) and
   ``transformer/utils.py`` (``get_default_causal_mask``, the causal mask of the local softmax); and
   ``torch.cuda.synchronize()`` in ``p2p_communication.py`` ``_communicate``; and in
   ``dist_checkpointing/strategies/state_dict_saver.py`` (``device='cuda'`` in
   ``verify_global_md_reuse``, ``device=torch.cuda.current_device()`` in
   ``save_state_dict_async_finalize``, 0.16.1 lines 204 / 252). Those modules see a ``torch`` proxy
   whose CUDA requests resolve to the CPU; the rest of the process is untouched.
3. ``models/common/embeddings/rope_utils.py`` ``get_pos_emb_on_this_cp_rank`` (CP > 1) pins memory
   and calls ``.cuda()``; the rotary module gets the same function without them.
4. Tied embeddings with PP > 1: ``models/common/language_module/language_module.py``
   ``LanguageModule.setup_embeddings_and_output_layer`` (0.16.1 line 244) moves the shared weight
   with ``weight.data = weight.data.cuda()`` before all-reducing it over the embedding group. The
   method is wrapped: megatron's body runs with ``_is_in_embd_group`` answering False (so it does all
   its other work: attributes, zero-filling the last stage's copy), then the same all-reduce runs
   on the CPU tensor.

Not shimmed (callers avoid them on CPU): sequence parallel (the local-spec ``WrappedTorchNorm``
asserts ``not config.sequence_parallel``: refused in ``transformer_config_from_hf``), the distributed
optimizer (refuses CPU tensors), ``clip_grad_by_total_norm_fp32`` (asserts CUDA tensors; use
``torch.nn.utils.clip_grad_norm_``), megatron DDP (0.17+ ``distributed/param_and_grad_buffer.py``
calls ``torch.cuda.current_stream()``; on CPU gradients are summed with ``all_reduce_gradients``).

megatron-core version differences handled here (supported: ``>=0.16.1,<0.20``):

- 0.18+: ``import megatron.core`` imports triton (``__init__`` -> ``distributed/finalize_model_grads``
  -> ``pipeline_parallel/schedules.py:27`` -> ``transformer/moe/paged_stash.py``), which megatron-core
  does not declare and CPU torch wheels do not bring: setup.py declares it for Python >= 3.12 (the
  only Pythons 0.17+ install on), and ``import_megatron_core`` names the cause when it is missing.
- 0.18+: ``utils.get_batch_on_this_cp_rank`` takes a required ``is_hybrid_cp`` before ``cp_group``:
  call ``get_batch_on_this_cp_rank`` here instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import inspect
import random
import socket
import types
from typing import Iterable, Mapping, Optional

import torch
import torch.distributed as dist

# Seed offsets follow megatron's model_parallel_cuda_manual_seed (tensor_parallel/random.py), so CPU
# and GPU runs draw dropout masks from the same seeds.
_TP_SEED_OFFSET = 2718
_EP_SEED_OFFSET = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Where this process sits in the job, as a launcher (torchrun, Slurm wrapper) describes it."""

    rank: int = 0
    """Global rank."""
    world_size: int = 1
    """Number of processes."""
    local_rank: int = 0
    """Rank on this node (selects the GPU)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host."""
    master_port: Optional[int] = None
    """Rendezvous port; None picks a free local port (single process only)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "LaunchEnv":
        """Read torchrun's variables; without them, a single process.

        >>> LaunchEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                         "MASTER_ADDR": "h", "MASTER_PORT": "29500"}).rank
        1
        >>> LaunchEnv.from_environ({}).world_size
        1
        """
        port = environ.get("MASTER_PORT")
        return cls(rank=int(environ.get("RANK", 0)), world_size=int(environ.get("WORLD_SIZE", 1)),
                   local_rank=int(environ.get("LOCAL_RANK", 0)),
                   master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(port) if port else None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """nccl when CUDA is usable, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize(parallel, *, seed: int, launch: Optional[LaunchEnv] = None,
               backend: Optional[str] = None, timeout_s: float = 1800.0) -> torch.device:
    """Join the process group, build megatron's parallel groups, seed; return this rank's device.

    ``parallel``: a ``megatron_credit.config.ParallelConfig``. If ``torch.distributed`` is already
    initialised (tests, an embedding application) its group and backend are used as they are; else a
    group is created from ``launch`` (default: one process). Raises ``ValueError`` before creating
    any megatron group if the sizes do not fit the world size.
    """
    import_megatron_core()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        launch = launch or LaunchEnv()
        parallel.validate(world_size=launch.world_size)
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(launch.local_rank)
        port = launch.master_port or _free_port()
        dist.init_process_group(backend, init_method=f"tcp://{launch.master_addr}:{port}",
                                rank=launch.rank, world_size=launch.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    backend = dist.get_backend()
    parallel.validate(world_size=dist.get_world_size())
    on_cpu = backend == "gloo" and not torch.cuda.is_available()
    if on_cpu:
        install_cpu_shims()
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
    )
    set_seed(seed, on_cpu=on_cpu)
    return device


def import_megatron_core():
    """``import megatron.core``, naming the cause when it fails for want of triton (0.18+).

    megatron-core 0.18.0+ imports triton at module scope on the unconditional import path
    (``pipeline_parallel/schedules.py:27`` -> ``transformer/moe/paged_stash.py``; NVIDIA/Megatron-LM
    PR #6891 proposes a guard) without declaring it; CUDA torch wheels bring triton, CPU ones do not.
    """
    try:
        import megatron.core
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise ImportError(
            "megatron-core >= 0.18 imports triton (pipeline_parallel/schedules.py -> "
            "transformer/moe/paged_stash.py) but does not declare it, and CPU torch wheels do not "
            "bring it: `pip install triton` (it imports without a GPU)") from e
    return megatron.core


def get_batch_on_this_cp_rank(batch: dict, *, cp_group=None) -> dict:
    """megatron's ``utils.get_batch_on_this_cp_rank`` (load-balanced CP split) on every version.

    megatron-core 0.18.0 inserted a required positional ``is_hybrid_cp`` before ``cp_group``
    (``utils.py``: ``get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group=None,
    hybrid_cp_group_func=None)``); 0.16 / 0.17 take ``(batch, cp_group=None)``. Plain (not hybrid)
    CP is what we run, so ``is_hybrid_cp=False`` where the parameter exists.
    """
    from megatron.core import utils as mutils

    fn = mutils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(fn).parameters:  # megatron-core >= 0.18
        return fn(batch, is_hybrid_cp=False, cp_group=cp_group)
    return fn(batch, cp_group=cp_group)  # megatron-core 0.16 / 0.17


def destroy(*, process_group: bool = False) -> None:
    """Tear down megatron's groups (and the default process group when ``process_group``)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


def set_seed(seed: int, *, on_cpu: bool) -> None:
    """Seed python, numpy and torch, and megatron's RNG tracker (TP-rank-dependent dropout seeds).

    Every rank gets the same default seed, so ``use_cpu_initialization`` builds the same full weights
    on every rank before slicing them (TP/PP shards of one model).
    """
    from megatron.core import parallel_state, tensor_parallel

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is a dependency; this only keeps seeding usable without it
        pass
    torch.manual_seed(seed)
    if not on_cpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    for name, stream_seed in cpu_rng_stream_seeds(
            seed, tp_rank=parallel_state.get_tensor_model_parallel_rank()).items():
        tracker.add(name, stream_seed)
    # Shim 1: tensor_parallel/random.py initialize_rng_tracker() returns early once
    # _CUDA_RNG_STATE_TRACKER_INITIALIZED is set, so get_cuda_rng_tracker() hands out this tracker
    # (unchanged 0.16.1 - 0.19.2; 0.19 adds GTP-remat streams only when that axis is > 1, never here).
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if mrandom.get_cuda_rng_tracker() is not tracker:
        raise RuntimeError("megatron-core's tensor_parallel.random.get_cuda_rng_tracker() no longer "
                           "returns _CUDA_RNG_STATE_TRACKER once _CUDA_RNG_STATE_TRACKER_INITIALIZED "
                           "is set: the CPU RNG shim (megatron_credit.distributed) needs updating")


def cpu_rng_stream_seeds(seed: int, *, tp_rank: int) -> dict[str, int]:
    """The named RNG streams of shim 1 and their seeds: those of megatron's
    ``model_parallel_cuda_manual_seed`` without expert parallelism (ep_rank 0, and the expert-TP rank
    equals the TP rank because ``expert_tensor_parallel_size`` defaults to the TP size)."""
    from megatron.core.tensor_parallel import random as mrandom

    return {mrandom._DATA_PARALLEL_RNG_TRACKER_NAME: seed,
            mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME: seed + _TP_SEED_OFFSET + tp_rank,
            mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME: seed + _EP_SEED_OFFSET + tp_rank}


class CpuRNGStatesTracker:
    """Megatron's ``CudaRNGStatesTracker`` interface over CPU generator states (shim 1)."""

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        """Run the body on the named stream of the default CPU generator, then restore it."""
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _CudaOnCpu(types.SimpleNamespace):
    """``torch.cuda`` as seen by a shimmed megatron module: the current device is the CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        """p2p_communication.py _communicate: torch.cuda.synchronize() after batch_isend_irecv;
        gloo's wait() has already completed the transfers."""


def _cpu_device(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs = dict(kwargs, device="cpu")
    return kwargs


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by a shimmed megatron module: CUDA device requests resolve to the CPU."""

    cuda = _CudaOnCpu()

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        return torch.zeros(*args, **_cpu_device(kwargs))

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **_cpu_device(kwargs))

    @staticmethod
    def ones(*args, **kwargs):
        return torch.ones(*args, **_cpu_device(kwargs))

    @staticmethod
    def tensor(*args, **kwargs):
        return torch.tensor(*args, **_cpu_device(kwargs))


# Shim 2: modules whose CUDA device requests the CPU runs reach (see the module docstring for lines).
_SHIMMED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq .to(current_device())
    "megatron.core.pipeline_parallel.p2p_communication",  # recv buffers on current_device()
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = torch.zeros(..., device="cuda")
    "megatron.core.tensor_parallel.mappings",  # _gather_along_first_dim buffers on current_device()
    "megatron.core.tensor_parallel.layers",  # SP all-gather buffers on current_device()
    "megatron.core.transformer.utils",  # get_default_causal_mask: torch.ones(..., device="cuda")
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor on current_device() (attention scores)
    # verify_global_md_reuse: torch.tensor(..., device='cuda') (line 204);
    # save_state_dict_async_finalize: device=torch.cuda.current_device() (line 252).
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)
_SHIMS_INSTALLED = False


# Shim 1's targets in tensor_parallel/random.py (module attributes set or read by set_seed).
_RNG_SHIM_ATTRIBUTES = ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
                        "_DATA_PARALLEL_RNG_TRACKER_NAME", "_MODEL_PARALLEL_RNG_TRACKER_NAME",
                        "_EXPERT_PARALLEL_RNG_TRACKER_NAME", "get_cuda_rng_tracker")


def cpu_shim_problems() -> list[str]:
    """What the CPU shims expect of the installed megatron-core but do not find (empty: all found).

    Assigning to a module attribute never fails, so a release that renames one of these would leave
    the shim silently inert; ``install_cpu_shims`` raises on any problem listed here instead.
    """
    problems = []
    mrandom = importlib.import_module("megatron.core.tensor_parallel.random")
    problems += [f"megatron.core.tensor_parallel.random.{a} is missing (shim 1)"
                 for a in _RNG_SHIM_ATTRIBUTES if not hasattr(mrandom, a)]
    for name in _SHIMMED_MODULES:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, "torch", None), types.ModuleType):
            problems.append(f"{name} has no module-level `torch` to redirect (shim 2)")
    rotary = importlib.import_module("megatron.core.models.common.embeddings.rotary_pos_embedding")
    rope_utils = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    for module, label in ((rotary, "rotary_pos_embedding"), (rope_utils, "rope_utils")):
        fn = getattr(module, "get_pos_emb_on_this_cp_rank", None)
        if fn is None:
            problems.append(f"megatron.core.models.common.embeddings.{label}."
                            "get_pos_emb_on_this_cp_rank is missing (shim 3)")
        elif fn is not _pos_emb_on_this_cp_rank_cpu and \
                list(inspect.signature(fn).parameters) != ["pos_emb", "seq_dim", "cp_group"]:
            problems.append(f"{label}.get_pos_emb_on_this_cp_rank{inspect.signature(fn)} is not "
                            "(pos_emb, seq_dim, cp_group) (shim 3)")
    language_module = importlib.import_module(_LANGUAGE_MODULE)
    cls = getattr(language_module, "LanguageModule", None)
    for attr in ("setup_embeddings_and_output_layer", "_is_in_embd_group",
                 "shared_embedding_or_output_weight"):
        if not callable(getattr(cls, attr, None)):
            problems.append(f"{_LANGUAGE_MODULE}.LanguageModule.{attr} is missing (shim 4)")
    return problems


def install_cpu_shims() -> None:
    """Install shims 2, 3 and 4 (idempotent). Shim 1 is installed by ``set_seed(on_cpu=True)``.

    Raises ``RuntimeError`` listing ``cpu_shim_problems()`` if megatron-core moved a target.
    """
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("CPU shims must not be installed on a machine with CUDA")
    problems = cpu_shim_problems()
    if problems:
        raise RuntimeError("megatron-core's CUDA-only code moved; the CPU shims in "
                           "megatron_credit/distributed.py need updating:\n  " + "\n  ".join(problems))
    proxy = _TorchOnCpu()
    for name in _SHIMMED_MODULES:
        module = importlib.import_module(name)
        module.torch = proxy
    # Shim 3: models/common/embeddings/rope_utils.py get_pos_emb_on_this_cp_rank builds its index
    # with torch.tensor(..., pin_memory=True).cuda(); rotary_pos_embedding.py imports it by name.
    rotary = importlib.import_module("megatron.core.models.common.embeddings.rotary_pos_embedding")
    rotary.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank_cpu
    # Shim 4: language_module.py:244 `weight.data = weight.data.cuda()` (tied embeddings, PP > 1).
    cls = importlib.import_module(_LANGUAGE_MODULE).LanguageModule
    cls.setup_embeddings_and_output_layer = _cpu_setup_embeddings_and_output_layer(
        cls.setup_embeddings_and_output_layer)
    _SHIMS_INSTALLED = True


_LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module"


def _cpu_setup_embeddings_and_output_layer(original):
    """Shim 4: megatron's ``setup_embeddings_and_output_layer`` without ``weight.data.cuda()``.

    megatron (0.16.1 language_module.py:241-244): ``if torch.distributed.is_initialized(): if
    self._is_in_embd_group(): weight.data = weight.data.cuda(); all_reduce(weight.data,
    group=self.embd_group)``. The original runs with ``_is_in_embd_group`` shadowed to answer False
    (and to record that megatron reached that question: it returns early without tied embeddings or
    with PP = 1), so it sets the parameter attributes and zero-fills the last stage's copy as usual;
    then, where megatron would have, the first stage's weights are summed into that zero copy over
    the embedding group.
    """
    def setup_embeddings_and_output_layer(self) -> None:
        asked = []
        self._is_in_embd_group = lambda: asked.append(True) and False  # shadows the method
        try:
            original(self)
        finally:
            del self._is_in_embd_group
        if asked and self._is_in_embd_group():
            dist.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)

    setup_embeddings_and_output_layer.__wrapped__ = original
    setup_embeddings_and_output_layer.__doc__ = original.__doc__
    return setup_embeddings_and_output_layer


def _pos_emb_on_this_cp_rank_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron's get_pos_emb_on_this_cp_rank (load-balanced chunks r, 2cp-1-r) without pinning."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    """Sum ``grads`` in place over ``group`` with one collective on a flat buffer.

    Every rank of ``group`` must pass tensors of the same shapes in the same order.
    """
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _grads_for_reduce(params: Iterable[torch.nn.Parameter], group) -> list[torch.Tensor]:
    """``.grad`` of every ``requires_grad`` param in the given order; a missing grad (the param was
    unused on this rank) becomes zeros, so every rank's flat buffer has the same layout."""
    params = [p for p in params if p.requires_grad]
    if dist.get_world_size(group) > 1:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    return [p.grad for p in params if p.grad is not None]


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], *, group) -> None:
    """Sum ``.grad`` of the ``requires_grad`` ``params`` over ``group`` (one flat buffer, one
    collective). Every rank passes the same parameters in the same order; a ``None`` grad counts as
    zeros (and is materialised) when the group has more than one rank."""
    _all_reduce_flat(_grads_for_reduce(params, group), group)


def finalize_gradients(model: torch.nn.Module, *, dp_cp_group, tp_group,
                       embedding_group=None) -> None:
    """Make ``.grad`` the gradient of the summed loss of all ranks (the CPU stand-in for megatron
    DDP + ``finalize_model_grads``, which need CUDA buffers).

    - ``dp_cp_group`` (``get_data_parallel_group(with_context_parallel=True)``): every DP and CP rank
      holds the gradient of its own samples / tokens for the same parameters: sum.
    - ``tp_group``: per-head q/k norms are replicated over TP but each rank only sees its own heads
      (and under sequence parallelism, norms only see their sequence shard): sum, as
      ``finalize_model_grads._allreduce_non_tensor_model_parallel_grads`` does.
    - ``embedding_group`` (tied embeddings across pipeline stages, ``get_embedding_group()``; pass
      it only on ranks in that group): the first stage's input embedding and the last stage's
      output copy are one parameter: sum.
    """
    config = model.config
    # All trainable params in module order (the same on every rank of a group), not only those
    # with a grad: a param unused on one rank must still take its slot in the flat buffers.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    all_reduce_gradients([p for _, p in named], group=dp_cp_group)
    tp_summed = [p for n, p in named
                 if (config.qk_layernorm and ("q_layernorm" in n or "k_layernorm" in n))
                 or (config.sequence_parallel and getattr(p, "sequence_parallel", False))]
    all_reduce_gradients(tp_summed, group=tp_group)
    if embedding_group is not None and getattr(model, "share_embeddings_and_output_weights", False):
        shared = model.shared_embedding_or_output_weight()
        if shared is not None:
            all_reduce_gradients([shared], group=embedding_group)
