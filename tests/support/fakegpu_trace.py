"""``python -m tests.support.fakegpu_trace TRACE pretrain_rl.py-arguments...``: the trainer's command line on
the emulated accelerator (:mod:`tests.support.fakegpu`), with the memory order of every generation phase
recorded: each rank writes ``TRACE.<rank>.json``, a list of events in the order they happened:

- ``["engine", gpus]``: the devices the rank's engine was given (engine leaders only);
- ``["empty_cache"]``, then ``["offload", bytes, grads_released, optimizer_released, tensors_to_host]`` after
  ``GenerationOffload.offload``;
- ``["wake", tags]``, ``["sync"]``, ``["generate"]``, ``["sleep"]``: the engine's calls;
- ``["restore", restored_exactly, tensors_back]``: after ``GenerationOffload.restore`` (every optimizer
  tensor equal to its host copy, no gradient buffer left released); ``["step"]``: an optimizer step.

Works under ``torch.distributed.run`` (each rank one process; the backend registration is process-wide).
"""
from __future__ import annotations

import json
import os
import sys


def _instrument(events: list) -> None:
    import functools

    import torch

    from megatron_credit.rollout.hf_engine import HFRolloutEngine
    from megatron_credit.trainer import offload as offload_mod
    from megatron_credit.trainer.actor import Actor

    def after(cls, name, make_event):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            events.append(make_event(self, out, *args, **kwargs))
            return out
        setattr(cls, name, wrapper if not isinstance(original, classmethod) else classmethod(wrapper))

    def optimizer_released(o) -> bool:
        return all(t.inner.untyped_storage().nbytes() == 0
                   for t in offload_mod.optimizer_tensors(o.optimizer, o.model.parameters()))

    def released(o) -> bool:
        return all(b.inner.untyped_storage().nbytes() == 0 for b in offload_mod.grad_buffers(o.ddp))

    after(offload_mod.GenerationOffload, "offload",
          lambda self, out: ["offload", out, all(map(released, self.owners)),
                             all(map(optimizer_released, self.owners)), len(self._host)])
    restore = offload_mod.GenerationOffload.restore

    def restored(self):
        host = [(t, h.clone()) for t, h in self._host]
        restore(self)
        events.append(["restore", all(torch.equal(t.inner, h) for t, h in host)
                       and not any(map(released, self.owners)), len(host)])
    offload_mod.GenerationOffload.restore = restored
    cache = offload_mod.empty_cache

    def empty_cache(device):
        events.append(["empty_cache"])
        return cache(device)
    offload_mod.empty_cache = empty_cache
    original = HFRolloutEngine.from_config.__func__

    def from_config(cls, *args, gpus=None, **kwargs):
        events.append(["engine", list(gpus)])
        return original(cls, *args, gpus=gpus, **kwargs)
    HFRolloutEngine.from_config = classmethod(from_config)
    after(HFRolloutEngine, "wake_up", lambda self, out, tags=None: ["wake", list(tags or [])])
    after(HFRolloutEngine, "update_weights", lambda self, out, *a, **k: ["sync"])
    after(HFRolloutEngine, "generate", lambda self, out, *a, **k: ["generate"])
    after(HFRolloutEngine, "sleep", lambda self, out: ["sleep"])
    after(Actor, "optimizer_step", lambda self, out, *a, **k: ["step"])


def main(argv: list[str]) -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    sys.path.insert(0, root)
    from tests.support.fakegpu import fake_cuda

    trace, args = argv[0], argv[1:]
    events: list = []
    with fake_cuda():
        import pretrain_rl

        _instrument(events)
        try:
            return pretrain_rl.main(args)
        finally:
            with open(f"{trace}.{os.environ.get('RANK', '0')}.json", "w", encoding="utf-8") as f:
                json.dump(events, f)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
