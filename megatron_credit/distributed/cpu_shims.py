"""The CPU shims megatron-core needs, and only they (installed by ``distributed.initialize`` on gloo
without CUDA).

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
   ``save_state_dict_async_finalize``, 0.16.1 lines 204 / 252); and the gradient buffer of megatron's
   DDP (``distributed/param_and_grad_buffer.py`` ``torch.zeros(..., device=torch.cuda.current_device())``,
   0.16.1 line 806; its CUDA streams are only made with ``overlap_grad_reduce``, off on CPU; checked on
   0.16.1 only); and the MoE router's weight move (``transformer/moe/router.py`` ``TopKRouter.gating``), and the all-to-all
   token dispatcher's side stream (``transformer/moe/token_dispatcher.py``, expert parallelism), whose
   split sizes reach ``torch.distributed.all_to_all_single`` (``tensor_parallel/mappings.py``) as CPU
   tensors, given to gloo as lists.
   Those modules see a ``torch`` proxy
   whose CUDA requests resolve to the CPU; the rest of the process is untouched.
3. ``models/common/embeddings/rope_utils.py`` ``get_pos_emb_on_this_cp_rank`` (CP > 1) pins memory
   and calls ``.cuda()``; the rotary module gets the same function without them.
4. Tied embeddings with PP > 1: ``models/common/language_module/language_module.py``
   ``LanguageModule.setup_embeddings_and_output_layer`` (0.16.1 line 244) moves the shared weight
   with ``weight.data = weight.data.cuda()`` before all-reducing it over the embedding group. The
   method is wrapped: megatron's body runs with ``_is_in_embd_group`` answering False (so it does all
   its other work: attributes, zero-filling the last stage's copy), then the same all-reduce runs
   on the CPU tensor.

5. megatron's optimizers check tensor types by name: ``Float16OptimizerWithFloat16Params.__init__``
   and ``DistributedOptimizer.__init__`` accept ``torch.cuda.{Half,BFloat16,Float}Tensor`` parameters
   only (0.16.1 optimizer.py 671 / 690, distrib_optimizer.py 361 / 420 / 582), and
   ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` gradients (clip_grads.py 167).
   Those callables run with ``tensor.type()`` answering the CUDA name of a CPU tensor; what they do
   with each dtype is megatron's own code. Checked on 0.16.1 only (like the optimizer modules in 2).

6. ``transformer/moe/moe_utils.py`` (0.16.1) defines ``te_general_gemm`` only when Transformer Engine
   imports, and the router's gating reads it; without TE it is set to None (megatron's own torch path).

Sequence parallelism is not a shim: the local spec's norm (``models/gpt.py``) supports it.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from typing import Mapping

import torch
import torch.distributed as dist


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

    @staticmethod
    def current_stream(device=None):
        """param_and_grad_buffer.py start_grad_sync (megatron-core 0.19): ``torch.cuda.current_stream()``
        waits on the CUDA-graph replay events of the parameters; the CPU has no graphs, so no events."""
        return _NO_STREAM

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802 (torch.cuda.Stream)
        """moe/token_dispatcher.py MoEAlltoAllTokenDispatcher: a side stream for its device-to-host copies
        (0.16.1 line 445); on the CPU it is the current stream, so the copies run in place."""
        return _NO_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _NoStream:
    """The current stream of the CPU: every op has completed when it returns."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> "_NoStream":
        """token_dispatcher.py: the event of the device-to-host copies (synchronized on later): done."""
        return self


_NO_STREAM = _NoStream()


def _cpu_device(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs = dict(kwargs, device="cpu")
    return kwargs


def _sizes(split):
    return split.tolist() if hasattr(split, "tolist") else split


class _DistributedOnCpu(types.SimpleNamespace):
    """``torch.distributed`` as seen by a shimmed megatron module: ``all_to_all_single`` takes the split
    sizes as lists. tensor_parallel/mappings.py ``_AllToAll`` (0.16.1 line 444) passes the all-to-all token
    dispatcher's split sizes as the tensors it would have moved to the host on CUDA (already on the CPU
    here, they stay tensors); gloo's binding accepts lists of ints only."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        return dist.all_to_all_single(output, input, output_split_sizes=_sizes(output_split_sizes),
                                      input_split_sizes=_sizes(input_split_sizes), **kwargs)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by a shimmed megatron module: CUDA device requests resolve to the CPU."""

    cuda = _CudaOnCpu()
    distributed = _DistributedOnCpu()

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
    # _ParamAndGradBuffer.__init__: the grad buffer torch.zeros(..., device=torch.cuda.current_device())
    # (0.16.1 lines 800-806): megatron's DDP on CPU.
    "megatron.core.distributed.param_and_grad_buffer",
    # optimizer.py: found_inf / _scale_one / _dummy_overflow_buf torch.tensor(..., device='cuda') (0.16.1
    # lines 473-485, 907), torch.cuda.current_device() (1141); clip_grads.py: device='cuda' buffers
    # (90-115, 174, 207); distrib_optimizer.py: buffers on torch.cuda.current_device() (791, 1077).
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    # moe/router.py TopKRouter.gating: `self.weight.data.to(device=torch.cuda.current_device())` on a CPU
    # weight (0.16.1 line 90, 0.19.2 line 98): the routed-expert (MoE) layers.
    "megatron.core.transformer.moe.router",
    # moe/token_dispatcher.py MoEAlltoAllTokenDispatcher (expert parallelism): torch.cuda.Stream() and
    # torch.cuda.stream(...) for its device-to-host copies of the split sizes (0.16.1 lines 445, 871-874).
    "megatron.core.transformer.moe.token_dispatcher",
)
# Shim 5: (module, qualified name) of the callables whose CUDA tensor-type checks see CUDA names.
_TYPE_CHECKED = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),  # 671, 690
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),  # 361, 420, 582
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),  # 167
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),  # the same, imported by name
)
_SHIMS_INSTALLED = False


# Shim 1's targets in tensor_parallel/random.py (module attributes set or read by set_seed).
_RNG_SHIM_ATTRIBUTES = ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
                        "_DATA_PARALLEL_RNG_TRACKER_NAME", "_MODEL_PARALLEL_RNG_TRACKER_NAME",
                        "_EXPERT_PARALLEL_RNG_TRACKER_NAME", "get_cuda_rng_tracker")


@contextlib.contextmanager
def _cuda_type_names():
    """Shim 5: within the block, ``tensor.type()`` (no arguments) of a CPU tensor answers the CUDA name
    (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``), so megatron's optimizers accept CPU
    parameters; their dtype branches are unchanged. Process-wide while the block runs (the wrapped
    constructors and the clip run on the calling thread, with no other work in between)."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") \
                and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    if getattr(fn, "_cpu_type_shim", False):
        return fn

    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper._cpu_type_shim = True
    wrapper.__wrapped__, wrapper.__doc__, wrapper.__name__ = fn, fn.__doc__, fn.__name__
    return wrapper


def _resolve(module_name: str, qualname: str):
    """(owner, attribute, value) of ``module.qualname`` or None."""
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    value = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    return None if value is None else (owner, attr, value)


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
    for module_name, qualname in _TYPE_CHECKED:
        if _resolve(module_name, qualname) is None:
            problems.append(f"{module_name}.{qualname} is missing (shim 5)")
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
                           "megatron_credit/distributed/cpu_shims.py need updating:\n  " + "\n  ".join(problems))
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
    # Shim 5: megatron's optimizers check parameters / gradients for CUDA tensor types.
    for module_name, qualname in _TYPE_CHECKED:
        owner, attr, value = _resolve(module_name, qualname)
        setattr(owner, attr, _with_cuda_type_names(value))
    define_missing_te_names()
    _SHIMS_INSTALLED = True


def define_missing_te_names() -> None:
    """Shim 6, on every device (a GPU without Transformer Engine too): moe/moe_utils.py (0.16.1) leaves
    ``te_general_gemm`` undefined when Transformer Engine is absent, and RouterGatingLinearFunction reads it
    (line 1192); None selects its torch.mm path. Idempotent."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
