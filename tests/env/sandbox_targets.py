"""Functions the sandbox tests run in worker processes, by reference (``tests.env.sandbox_targets:NAME``).

Standard library only: a worker imports this module, and it must stay torch-free.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys


def shout(arg: str) -> str:
    return arg.upper() + "!"


def fail(arg: str) -> str:
    raise ValueError(f"bad {arg}")


def not_a_string(arg: str) -> int:
    return len(arg)


def spin(arg: str) -> str:
    while True:
        pass


def allocate(arg: str) -> str:
    """Allocate ``arg`` MiB and touch it."""
    block = bytearray(int(arg) << 20)
    return str(len(block))


def crash(arg: str) -> str:
    os._exit(int(arg))


def open_socket(arg: str) -> str:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    return "socket created"


def resolve(arg: str) -> str:
    return str(socket.getaddrinfo(arg, 80))


def start_process(arg: str) -> str:
    return str(subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout)


def shell(arg: str) -> str:
    return str(os.system("true"))


def fork(arg: str) -> str:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return str(pid)


def loaded_modules(arg: str) -> str:
    """Which of the comma-separated module names ``arg`` this worker has imported."""
    return ",".join(name for name in arg.split(",") if name in sys.modules)


def network_namespace(arg: str) -> str:
    return os.readlink("/proc/self/ns/net")
