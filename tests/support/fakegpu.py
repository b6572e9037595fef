"""An emulated accelerator for CPU tests of device placement (docs/architecture.md "Where the code runs").

``with fake_cuda():`` makes this process look like a one-GPU machine whose tensors keep CPU data:

- the PrivateUse1 backend is registered from Python as ``fakegpu`` (``torch.utils.backend_registration.
  _setup_privateuseone_for_python_backend``; process-wide and irreversible, so each scenario runs in a
  process of its own: :func:`run_scenario`);
- a :class:`FakeGpuTensor` is a ``_make_wrapper_subclass`` tensor on ``fakegpu:0`` holding its real
  data in an inner CPU tensor; every op unwraps, runs on the CPU and re-wraps, and **raises, as CUDA
  does, when an op mixes a non-scalar CPU tensor with a fakegpu one** (``copy_`` / ``_to_copy`` move
  data between devices; ``index`` / ``index_put_`` take CPU indices, as CUDA's do);
- a ``TorchDispatchMode`` makes factories with ``device=fakegpu`` fakegpu tensors; a ``TorchFunctionMode``
  maps ``.cuda()``, ``device="cuda"`` / ``torch.device("cuda", i)`` / an integer device to ``fakegpu:0``,
  builds ``torch.tensor(..., device=)`` on the CPU then moves it (it bypasses dispatch), makes
  ``pin_memory()`` the identity and ``tensor.type()`` of a fakegpu tensor answer ``torch.cuda.*Tensor``
  (megatron's optimizers check parameter types by that name);
- ``torch.cuda.is_available / current_device / set_device / synchronize / device_count / current_stream`` answer like a
  one-GPU machine; megatron's ``model_parallel_cuda_manual_seed`` installs the CPU RNG tracker with the
  seeds megatron's CUDA tracker would use (CUDA generators do not exist here);
- ``Tensor.data = x`` (megatron's ``deallocate_output_tensor``, the tied embedding's ``.cuda()``) works
  on fakegpu tensors, and so does the trainer's release of a storage around generation (``trainer/offload.py``
  resizes the inner tensor's storage: a wrapper has none of its own).

The backend name is ``fakegpu``, not ``cuda``: code that checks ``device.type == "cuda"`` sees a CUDA
device only where it asked for one by name (``torch.device("cuda")``). FakeTensorMode was tried first
and fails in autograd's C++ stream code.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

NAME = "fakegpu"
_REGISTERED = False


def register() -> torch.device:
    """Register the ``fakegpu`` backend once per process; returns ``fakegpu:0``."""
    global _REGISTERED
    if not _REGISTERED:
        torch.utils.backend_registration._setup_privateuseone_for_python_backend(NAME)
        _REGISTERED = True
    return torch.device(NAME, 0)


class DeviceMixError(RuntimeError):
    """An op mixed a CPU tensor with a fakegpu one (CUDA raises the same)."""


# Ops that may take CPU tensors next to fakegpu ones, and which of their arguments may be CPU.
_MIX_OK = {"aten::copy_": None, "aten::_to_copy": None, "aten::_copy_from": None,
           "aten::_copy_from_and_resize": None, "aten::index.Tensor": "indices",
           "aten::index_put_": "indices", "aten::_index_put_impl_": "indices", "aten::index_put": "indices",
           "aten::lift_fresh": None, "aten::set_.source_Tensor": None}


def _is_fake(x) -> bool:
    return isinstance(x, FakeGpuTensor)


def _cpu_nonscalar(x) -> bool:
    return isinstance(x, torch.Tensor) and not _is_fake(x) and x.dim() > 0 and x.device.type == "cpu"


def _check_mix(func, args, kwargs) -> None:
    name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
    allowed = _MIX_OK.get(name, _MIX_OK.get(func._schema.name, "none"))
    if allowed is None:
        return
    bad = []
    for i, a in enumerate(func._schema.arguments):
        if a.name == allowed:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        flat, _ = tree_flatten(v)
        bad += [t for t in flat if _cpu_nonscalar(t)]
    if bad:
        raise DeviceMixError(f"Expected all tensors to be on the same device, but found at least two devices, "
                             f"cpu, {NAME}:0! (in {func}; a CPU tensor of shape {tuple(bad[0].shape)})")


def _to_host(func, args, kwargs) -> bool:
    """``func`` copies to the CPU: ``aten::_to_copy``, or ``aten::to`` itself, which is what ``.cpu()`` and
    ``.to("cpu")`` reach the subclass as under ``torch.inference_mode`` (the HF engine's rollout)."""
    name = func._schema.name
    if func is not torch.ops.aten._to_copy.default and name != "aten::to":
        return False
    device = kwargs.get("device")
    if device is None and name == "aten::to":  # to.device takes it positionally
        device = next((a for a in args[1:2] if isinstance(a, (torch.device, str))), None)
    return device is not None and torch.device(device).type == "cpu"


def _fake_device(device) -> bool:
    return device is not None and torch.device(device).type == NAME


class FakeGpuTensor(torch.Tensor):
    """A tensor on ``fakegpu:0`` whose data is the CPU tensor ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False):
        assert not isinstance(inner, FakeGpuTensor) and inner.device.type == "cpu", inner.device
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=torch.device(NAME, 0), requires_grad=requires_grad)

    def __init__(self, inner: torch.Tensor, requires_grad: bool = False):
        self.inner = inner

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FakeGpuTensor({self.inner!r}, device='{NAME}:0')"

    # ``t.data = x`` (megatron's make_viewless_tensor / deallocate_output_tensor): torch copies the
    # wrapper's metadata (shape, strides); the data is the inner tensor, which must follow.
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value):
        if not _is_fake(value):
            raise DeviceMixError(f"tensor.data = a {value.device} tensor on a {NAME} tensor")
        torch._C.TensorBase.data.__set__(self, value)
        self.inner = value.inner

    # A traceable wrapper subclass: Module._apply (``.cuda()`` / ``.to()``) then swaps the tensor in place
    # (the Parameter object, and so weight tying and megatron's attributes on it, are kept) as CUDA's
    # ``param.data = ...`` path does.
    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return FakeGpuTensor(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_mix(func, args, kwargs)
        to_cpu = _to_host(func, args, kwargs)
        if to_cpu and func._schema.name == "aten::to":
            kwargs = {**kwargs, "copy": True}  # a copy, as from a device; never the inner tensor itself
        if _READS["on"] is not None:
            kind = _read_kind(func, args, kwargs, to_cpu)
            if kind is not None:
                _READS["on"].record(kind)
        return _run_on_cpu(func, args, kwargs, wrap=not to_cpu)


# -- device-to-host reads ---------------------------------------------------------------------------------
# What makes the host wait for a CUDA device: a value read back (``.item()``, ``float()``, the truth value of
# a tensor, ``.tolist()``, ``.cpu()``, ``torch.equal``) or an op whose output shape depends on the data
# (``nonzero``, boolean indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
# ``output_size``). :func:`counting_reads` records each with the code that asked for it.
_READ_OPS = {"aten::_local_scalar_dense": "item", "aten::is_nonzero": "item", "aten::equal": "equal",
             "aten::allclose": "equal", "aten::nonzero": "nonzero", "aten::nonzero_static": None,
             "aten::masked_select": "masked_select", "aten::_unique2": "unique", "aten::unique_dim": "unique",
             "aten::unique_consecutive": "unique", "aten::unique_dim_consecutive": "unique",
             "aten::bincount": "bincount"}
_READS: dict = {"on": None}


def _read_kind(func, args, kwargs, to_cpu: bool) -> "str | None":
    name = func._schema.name
    if name in _READ_OPS:
        return _READ_OPS[name]
    if to_cpu:
        return "to(cpu)"
    if name == "aten::copy_" and not _is_fake(args[0]) and any(_is_fake(a) for a in args[1:2]):
        return "copy_(cpu)"
    if name == "aten::repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None \
            and (len(args) < 3 or args[2] is None):
        return "repeat_interleave"
    if name in ("aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_put"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return "boolean index"
    return None


class Reads:
    """Device-to-host reads recorded by :func:`counting_reads`: ``events`` is a list of ``(kind, owner, site,
    phase)``; ``owner`` is ``"project"`` (megatron_credit/, pretrain_rl.py), ``"megatron-core"``, ``"transformers"`` or
    ``"other"`` (torch itself, the tests), from the innermost frame of any of the first three; ``site`` its
    ``path:line``; ``phase`` the innermost of :meth:`phase`'s labels."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str]] = []
        self.phases: list[str] = ["other"]

    @contextlib.contextmanager
    def phase(self, label: str):
        self.phases.append(label)
        try:
            yield
        finally:
            self.phases.pop()

    def record(self, kind: str) -> None:
        import sys

        owner, site = "other", "?"
        f = sys._getframe(2)
        while f is not None:
            path = f.f_code.co_filename.replace("\\", "/")
            if "/megatron/core/" in path:
                owner, site = "megatron-core", path[path.index("megatron/core/"):] + f":{f.f_lineno}"
                break
            if "/transformers/" in path:
                owner, site = "transformers", path[path.rindex("transformers/"):] + f":{f.f_lineno}"
                break
            if "/megatron_credit/" in path or path.endswith("/pretrain_rl.py"):
                cut = path.rfind("/megatron_credit/")
                owner = "project"
                site = (path[cut + 1:] if cut >= 0 else "pretrain_rl.py") + f":{f.f_lineno}"
                break
            f = f.f_back
        self.events.append((kind, owner, site, self.phases[-1]))

    def count(self, *, owner: "str | None" = None, phase: "str | None" = None) -> int:
        return sum(1 for _, o, _, p in self.events if (owner is None or o == owner) and (phase is None or p == phase))

    def sites(self, *, owner: "str | None" = None, phase: "str | None" = None) -> dict[str, int]:
        """``{"site kind": count}`` of the matching reads, most frequent first."""
        out: dict[str, int] = {}
        for kind, o, site, p in self.events:
            if (owner is None or o == owner) and (phase is None or p == phase):
                out[f"{site} {kind}"] = out.get(f"{site} {kind}", 0) + 1
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


@contextlib.contextmanager
def counting_reads():
    """Record every device-to-host read of fakegpu tensors while inside (use within :func:`fake_cuda`)."""
    reads = Reads()
    outer, _READS["on"] = _READS["on"], reads
    try:
        yield reads
    finally:
        _READS["on"] = outer


def _unwrap(x):
    if _is_fake(x):
        return x.inner
    if isinstance(x, torch.device) and x.type == NAME:
        return torch.device("cpu")
    return x


def _run_on_cpu(func, args, kwargs, *, wrap: bool):
    """Run ``func`` on the inner tensors; mutated arguments are returned as the objects passed in, other
    tensor outputs are wrapped (``wrap``) or returned as CPU tensors."""
    uargs, ukwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
    if "device" in ukwargs and _fake_device(kwargs.get("device")):
        ukwargs["device"] = torch.device("cpu")
    out = func(*uargs, **ukwargs)
    schema = func._schema
    written: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for s in a.alias_info.before_set:
                written[s] = v
    outs = out if isinstance(out, (tuple, list)) else (out,)
    fixed = []
    for r, o in zip(schema.returns, outs) if len(schema.returns) == len(outs) else ((None, o) for o in outs):
        info = getattr(r, "alias_info", None)
        if info is not None and info.is_write and info.before_set and next(iter(info.before_set)) in written:
            fixed.append(written[next(iter(info.before_set))])
        elif isinstance(o, torch.Tensor) and wrap and not _is_fake(o) and o.device.type == "cpu":
            fixed.append(FakeGpuTensor(o))
        elif isinstance(o, (list, tuple)) and wrap:
            fixed.append(type(o)(FakeGpuTensor(t) if isinstance(t, torch.Tensor) else t for t in o))
        else:
            fixed.append(o)
    return type(out)(fixed) if isinstance(out, (tuple, list)) else fixed[0]


class _FactoryMode(TorchDispatchMode):
    """Factories (no tensor input) with ``device=fakegpu`` make fakegpu tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _fake_device(kwargs.get("device")) and not any(_is_fake(t) for t in tree_flatten((args, kwargs))[0]):
            return _run_on_cpu(func, args, kwargs, wrap=True)
        return func(*args, **kwargs)


def _map_device(d):
    """``"cuda"``, ``"cuda:0"``, ``torch.device("cuda", 0)``, ``0`` -> ``fakegpu:0``; others unchanged."""
    if isinstance(d, bool):
        return d
    if isinstance(d, int):
        return torch.device(NAME, 0)
    if isinstance(d, str) and d.split(":")[0] == "cuda":
        return torch.device(NAME, 0)
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device(NAME, 0)
    return d


_TENSOR_CTORS = {torch.tensor, torch.as_tensor, torch.scalar_tensor}


class _DeviceMode(TorchFunctionMode):
    """``.cuda()`` and CUDA / integer device arguments -> ``fakegpu:0``; see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0].to(torch.device(NAME, 0), non_blocking=kwargs.get("non_blocking", False))
        if func in (torch.Tensor.pin_memory,):
            return args[0]
        if func is torch.Tensor.tolist and _is_fake(args[0]):
            if _READS["on"] is not None:
                _READS["on"].record("tolist")
            return args[0].inner.tolist()
        if func is torch.Tensor.numpy and _is_fake(args[0]):  # as CUDA: .cpu() first
            raise TypeError(f"can't convert {NAME}:0 device type tensor to numpy. Use Tensor.cpu() first")
        if func is torch.Tensor.is_pinned:
            return False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and _is_fake(args[0]):
            name = torch.Tensor.type(args[0].inner)
            return "torch.cuda." + name[len("torch."):]
        if func is torch.Tensor.to or func is torch.Tensor.new_empty:
            args = tuple(_map_device(a) if isinstance(a, (str, torch.device)) or (type(a) is int and i == 1
                         and func is torch.Tensor.to) else a for i, a in enumerate(args))
        if func in _TENSOR_CTORS:  # bypass dispatch: build on the CPU (from fakegpu data too), then move
            has_fake = any(_is_fake(t) for t in tree_flatten(args)[0])
            if has_fake and "device" not in kwargs:  # torch.tensor([fake scalars]) lands on their device
                kwargs["device"] = torch.device(NAME, 0)
            if _READS["on"] is not None and args and isinstance(args[0], (list, tuple)) \
                    and any(_is_fake(t) for t in tree_flatten(args[0])[0]):  # CUDA reads each device scalar
                _READS["on"].record("tensor(device scalars)")
            if _fake_device(kwargs.get("device")):
                device = kwargs.pop("device")
                data = tree_map(lambda t: t.inner if _is_fake(t) else t, args)
                return func(*data, **kwargs).to(device)
        return func(*args, **kwargs)


# -- collectives: NCCL's contract (device tensors only), run by gloo on the inner CPU tensors ------------
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "_all_gather_base", "_reduce_scatter_base", "reduce", "send", "recv", "isend", "irecv",
                "all_to_all_single", "reduce_scatter", "gather", "scatter")
_OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list")
_STATE = {"object_depth": 0, "collective_depth": 0}
CollectiveDeviceError = DeviceMixError


def _gloo_groups() -> list:
    """megatron's own gloo groups (``parallel_state.*_GLOO``): CPU tensors are right there."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return []
    return [v for k, v in vars(ps).items() if k.endswith("_GLOO") and v is not None]


def _unwrap_p2p(x):
    if isinstance(x, torch.distributed.P2POp) and _is_fake(x.tensor):
        x.tensor = x.tensor.inner
    return x


def _collective(name, original):
    def run(*args, **kwargs):
        group = kwargs.get("group")
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.distributed.P2POp):
                flat.append(x.tensor)
        cpu = [t for t in flat if not _is_fake(t)]
        if cpu and not (_STATE["object_depth"] or _STATE["collective_depth"]) \
                and not any(group is g for g in _gloo_groups()):
            raise CollectiveDeviceError(f"torch.distributed.{name} with a CPU tensor of shape "
                                        f"{tuple(cpu[0].shape)}: NCCL takes device tensors only")
        _STATE["collective_depth"] += 1  # c10d re-enters through __torch_function__ with the inner tensors
        try:
            return original(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        finally:
            _STATE["collective_depth"] -= 1
    return run


def _batch_p2p(original):
    def run(ops):
        return original([_unwrap_p2p(op) for op in ops])
    return run


def _object_collective(original):
    def run(*args, **kwargs):
        _STATE["object_depth"] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _STATE["object_depth"] -= 1
    return run


def _swap_keeping_attributes(original):
    """``torch.utils.swap_tensors`` as ``Module._apply`` uses it for a wrapper subclass, keeping the
    attributes megatron sets on a parameter (``tensor_model_parallel``, ``shared``...): CUDA's ``.cuda()``
    keeps the Parameter object and its attributes (``param.data = ...``)."""
    def run(t1, t2):
        kept = {k: v for k, v in t1.__dict__.items() if k != "inner"}
        original(t1, t2)
        for k, v in kept.items():
            t1.__dict__.setdefault(k, v)
    return run


def _collective_patches(mock) -> list:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    out = []
    for name in _COLLECTIVES:
        if hasattr(c10d, name):
            wrapped = _collective(name, getattr(c10d, name))
            out += [mock.patch.object(c10d, name, wrapped), mock.patch.object(dist, name, wrapped)]
    for name in _OBJECT_COLLECTIVES:
        if hasattr(c10d, name):
            wrapped = _object_collective(getattr(c10d, name))
            out += [mock.patch.object(c10d, name, wrapped), mock.patch.object(dist, name, wrapped)]
    wrapped = _batch_p2p(c10d.batch_isend_irecv)
    out += [mock.patch.object(c10d, "batch_isend_irecv", wrapped), mock.patch.object(dist, "batch_isend_irecv", wrapped)]
    return out


@contextlib.contextmanager
def fake_cuda():
    """The emulated one-GPU machine (see the module docstring); yields ``fakegpu:0``."""
    from unittest import mock

    from megatron_credit.distributed.cpu_shims import _NoStream

    device = register()
    patches = [mock.patch("torch.cuda.is_available", lambda: True),
               mock.patch("torch.cuda.current_device", lambda: 0),
               mock.patch("torch.cuda.device_count", lambda: 1),
               mock.patch("torch.cuda.set_device", lambda d: None),
               mock.patch("torch.cuda.synchronize", lambda d=None: None),
               # megatron-core 0.19's start_grad_sync waits on CUDA-graph events of the current stream
               mock.patch("torch.cuda.current_stream", lambda device=None: _NoStream()),
               # megatron's all-to-all MoE dispatcher copies its split sizes to the host on a side stream
               mock.patch("torch.cuda.Stream", _side_stream_class()),
               mock.patch("torch.cuda.stream", lambda stream: contextlib.nullcontext()),
               mock.patch("torch.cuda.empty_cache", lambda: None),
               mock.patch("torch.Generator", _HostGenerator),
               mock.patch("torch.cuda.get_rng_state", lambda device="cuda": _CUDA_RNG["state"].clone()),
               mock.patch("torch.cuda.set_rng_state", lambda state, device="cuda": _CUDA_RNG.update(state=state.clone())),
               # NCCL is emulated by gloo plus the device checks of the collectives below
               mock.patch("torch.distributed.init_process_group", _gloo_for_nccl(torch.distributed.init_process_group))]
    try:
        from megatron.core import tensor_parallel

        patches.append(mock.patch.object(tensor_parallel, "model_parallel_cuda_manual_seed", _cpu_rng_seed))
        patches.append(mock.patch("megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed",
                                  _cpu_rng_seed))
    except ImportError:
        pass
    patches += _collective_patches(mock)
    patches.append(mock.patch("torch.utils.swap_tensors", _swap_keeping_attributes(torch.utils.swap_tensors)))
    # The trainer frees device memory around generation by resizing storages (trainer/offload.py); a wrapper
    # tensor has no storage of its own: its inner CPU tensor's is what a CUDA tensor's would be.
    patches += [mock.patch("megatron_credit.trainer.offload.release_storage", _release_inner_storage),
                mock.patch("megatron_credit.trainer.offload.restore_storage", _restore_inner_storage)]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(_FactoryMode())
        stack.enter_context(_DeviceMode())
        yield device


def _side_stream_class() -> type:
    """``torch.cuda.Stream``: a class (annotations such as ``torch.cuda.Stream | None`` still work) whose
    instances are the CPU's one stream: work on a side stream has completed when it returns."""
    from megatron_credit.distributed.cpu_shims import _NO_STREAM, _NoStream

    class Stream(_NoStream):
        def __new__(cls, *args, **kwargs):
            return _NO_STREAM
    return Stream


def _inner(t: torch.Tensor) -> torch.Tensor:
    return t.inner if isinstance(t, FakeGpuTensor) else t


def _release_inner_storage(t: torch.Tensor) -> int:
    storage = _inner(t).untyped_storage()
    nbytes = storage.nbytes()
    if nbytes:
        storage.resize_(0)
    return nbytes


def _restore_inner_storage(t: torch.Tensor, nbytes: int) -> None:
    _inner(t).untyped_storage().resize_(nbytes)
    t.zero_()


_Generator = torch.Generator


class _HostGenerator(_Generator):
    """``torch.Generator(device="cuda")``: a CPU generator (the fakegpu's ops run on the CPU)."""

    def __new__(cls, device="cpu"):
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return _Generator.__new__(cls, "cpu" if d.type in ("cuda", NAME) else d)

    def __init__(self, device="cpu"):
        pass


_CUDA_RNG = {"state": torch.Generator().manual_seed(0).get_state()}


def _gloo_for_nccl(original):
    def run(backend=None, *args, **kwargs):
        if backend in (None, "nccl"):  # gloo in NCCL's place: NCCL's binding to a device (device_id) has no stand-in
            backend = "gloo"
            kwargs.pop("device_id", None)
        return original(backend, *args, **kwargs)
    return run


def _cpu_rng_seed(seed: int, *args, **kwargs) -> None:
    """megatron's ``model_parallel_cuda_manual_seed`` with CPU generators (no CUDA generators here)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_credit.distributed import cpu_rng_stream_seeds
    from megatron_credit.distributed.cpu_shims import CpuRNGStatesTracker

    tracker = CpuRNGStatesTracker()
    for name, s in cpu_rng_stream_seeds(seed, tp_rank=parallel_state.get_tensor_model_parallel_rank()).items():
        tracker.add(name, s)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
