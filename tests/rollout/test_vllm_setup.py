"""CPU tests of the pure set-up functions of the vLLM engine (``rollout/vllm_setup.py``) that need no
engine, fake or real: the weight transfer's environment, the engine's GPUs, its memory settings and the
in-process launcher's limits. Each guards a way in which vLLM (0.32 - 0.34) would stop, or silently
misplace, an engine the trainer builds."""
import pytest

from megatron_credit.rollout.vllm_setup import resolve_transfer, vllm_platform, weight_transfer_env


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
