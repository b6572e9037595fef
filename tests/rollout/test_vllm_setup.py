"""CPU tests of the pure set-up functions of the vLLM engine (``rollout/vllm_setup.py``) that need no
engine, fake or real: the weight transfer's environment, the engine's GPUs, its memory settings and the
in-process launcher's limits. Each guards a way in which vLLM (0.32 - 0.34) would stop, or silently
misplace, an engine the trainer builds."""
import pytest

from megatron_credit.recipe.sections import launcher_problem
from megatron_credit.rollout.vllm_setup import (engine_visible_devices, resolve_transfer,
                                                vllm_platform, weight_transfer_env)


# ------------------------------------------------------------------------------------- weight transfer
def _env(transfer="cuda_ipc", environ=None, **kw):
    return weight_transfer_env(transfer, tensor_parallel_size=kw.pop("tp", 1), v1_multiprocessing=kw.pop("multi", True),
                               distributed_executor_backend=kw.pop("backend", None), environ=environ or {}, **kw)


def test_cuda_ipc_sets_the_insecure_serialization_vllm_needs_for_its_handles():
    # The default on CUDA is CUDA IPC; vLLM's msgpack transport (v1/serial_utils.py) refuses its handles
    # unless VLLM_ALLOW_INSECURE_SERIALIZATION=1, and no recipe sets that: the transfer must.
    transfer, multi = resolve_transfer(vllm_platform(cuda=True), None, None, {})
    assert (transfer, multi) == ("cuda_ipc", True)
    assert _env(transfer, multi=multi) == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                                           "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert _env(environ={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    for value in ("0", "true"):  # vLLM reads int(value): "true" would crash it
        with pytest.raises(ValueError, match=f"sets VLLM_ALLOW_INSECURE_SERIALIZATION='{value}'"):
            _env(environ={"VLLM_ALLOW_INSECURE_SERIALIZATION": value})
    with pytest.raises(ValueError, match="allow_insecure_serialization=False forbids it"):
        _env(allow_insecure_serialization=False)
    # The other transfers leave the variable alone.
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in _env("serialized")
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in _env("in_process", multi=False)


# ---------------------------------------------------------------------------------------- engine GPUs
def _vllm_worker_gpus(environ, tp):
    """The physical GPUs vLLM's multiprocess executor uses: TP worker i on local device i of the
    environment its processes inherit (``CUDA_VISIBLE_DEVICES``, or every GPU)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    return [visible.split(",")[i] if visible is not None else str(i) for i in range(tp)]


def test_engines_of_one_node_own_disjoint_gpus():
    trainer_env = {}
    # Without a CUDA_VISIBLE_DEVICES of their own, both engines' workers land on GPUs 0 and 1.
    assert _vllm_worker_gpus(trainer_env, 2) == _vllm_worker_gpus(trainer_env, 2) == ["0", "1"]
    a, b = (engine_visible_devices(g, trainer_env) for g in ((0, 1), (2, 3)))
    assert (a, b) == ("0,1", "2,3")
    got = [_vllm_worker_gpus({"CUDA_VISIBLE_DEVICES": v}, 2) for v in (a, b)]
    assert got == [["0", "1"], ["2", "3"]] and not set(got[0]) & set(got[1])


def test_engine_gpus_map_through_the_trainers_own_visible_devices():
    assert engine_visible_devices((2, 3), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "6,7"
    uuids = "GPU-aa,GPU-bb,GPU-cc,GPU-dd"
    assert engine_visible_devices((3, 2), {"CUDA_VISIBLE_DEVICES": uuids}) == "GPU-dd,GPU-cc"
    with pytest.raises(ValueError, match="not all visible.*shows 2 device"):
        engine_visible_devices((1, 2), {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match="not all visible.*shows 0 device"):
        engine_visible_devices((0,), {"CUDA_VISIBLE_DEVICES": ""})
    for bad in ((), (1, 1), (-1,), ("0",)):
        with pytest.raises(ValueError, match="distinct CUDA ordinals"):
            engine_visible_devices(bad, {})


def test_cuda_ipc_workers_find_the_actors_gpu_in_their_restricted_view(monkeypatch):
    """The actor tags its handles with its GPU's uuid; each worker maps it to its own ordinal. With the
    engine's processes restricted to ``gpus``, the actor's GPU (``gpus[0]``) is the workers' device 0."""
    from megatron_credit.rollout import vllm_worker

    physical = {"0": "GPU-aa", "1": "GPU-bb", "2": "GPU-cc", "3": "GPU-dd"}  # index -> uuid on this node
    trainer_view = ["1", "0", "3", "2"]  # the trainer process's CUDA_VISIBLE_DEVICES=1,0,3,2
    gpus = (2, 3)  # the building rank's GPU is its cuda:2, physical GPU 3
    worker_view = engine_visible_devices(gpus, {"CUDA_VISIBLE_DEVICES": ",".join(trainer_view)}).split(",")
    assert worker_view == ["3", "2"]
    actor_uuid = physical[trainer_view[gpus[0]]]  # what pack_ipc_bucket records
    monkeypatch.setattr(vllm_worker.torch.cuda, "device_count", lambda: len(worker_view))
    monkeypatch.setattr(vllm_worker, "cuda_device_uuid", lambda i: physical[worker_view[i]])
    assert vllm_worker.local_device_index(actor_uuid) == 0
    with pytest.raises(RuntimeError, match="not visible to this vLLM worker"):
        vllm_worker.local_device_index(physical["0"])  # another engine's GPU


# ---------------------------------------------------------------------------------- in-process launcher
_LAUNCHER = {"engine_kwargs": {"distributed_executor_backend": "external_launcher"}}


@pytest.mark.parametrize("tp,pp,cp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (4, 2, 2)])
def test_an_in_process_launcher_engine_is_refused_under_a_split_trainer(tp, pp, cp):
    problem = launcher_problem(_LAUNCHER, tp=tp, pp=pp, cp=cp)
    assert problem == ("rollout.engine_options.engine_kwargs.distributed_executor_backend=external_launcher needs "
                       "parallel.tensor_model_parallel_size = pipeline_model_parallel_size = context_parallel_size "
                       f"= 1 (got {tp}, {pp}, {cp}): vLLM would build its groups over the trainer's whole world; use "
                       "the default multiprocess engine")
    assert "\n" not in problem


def test_an_in_process_launcher_engine_needs_rollout_tp_1():
    assert launcher_problem(_LAUNCHER, tp=1, pp=1, cp=1) is None
    problem = launcher_problem({**_LAUNCHER, "tensor_parallel_size": 2}, tp=1, pp=1, cp=1)
    assert problem.startswith("rollout.engine_options.engine_kwargs.distributed_executor_backend=external_launcher "
                              "needs rollout.engine_options.tensor_parallel_size = 1 (got 2)")


def test_other_executors_are_not_the_launchers_concern():
    for options in ({}, {"engine_kwargs": None}, {"tensor_parallel_size": 8},
                    {"engine_kwargs": {"distributed_executor_backend": "mp"}}):
        assert launcher_problem(options, tp=8, pp=4, cp=2) is None
