"""``python -m tests.support.fakegpu_run pretrain_rl.py-arguments...``: the trainer's command line on the emulated
accelerator of :mod:`tests.support.fakegpu` (each launch is a process of its own: the backend registration
is process-wide). Works under ``torch.distributed.run`` too: ``distributed.initialize`` asks for NCCL
(``torch.cuda.is_available()`` answers True) and gets gloo behind NCCL's device checks."""
from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    sys.path.insert(0, root)
    from tests.support.fakegpu import fake_cuda

    with fake_cuda():
        import pretrain_rl

        return pretrain_rl.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
