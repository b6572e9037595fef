"""Where a rollout pool's engine leader keeps the weight versions it receives (``sources/bridge.py``) until
its engine loads them (``sources/pool.py``): a ring of host chunks, pinned on a GPU, allocated once and
reused by every version.

The ring has :data:`~megatron_credit.planning.pool.STAGING_BANKS` banks of chunks, one chunk per bucket of a
version, each the size of that bucket as torch's pinned host allocator holds it (the next power of two:
:func:`~megatron_credit.planning.pool.host_block_bytes`). A bank's chunk is allocated the first time a
version is received into that bank and is reused by every later version (every version is bucketed alike:
the same model, the same ``bucket_bytes``), so the pinned bytes never grow past what ``planning/pool.py``
plans. A bank is, in turn:

| state | holds |
| --- | --- |
| free | nothing a reader needs: the next receipt may write it |
| receiving | the version being received (never read: half written) |
| staged | the newest complete version not loaded yet (at most one bank: staging a newer one frees it) |
| loading | the version the engine is loading (freed when the load returns) |

A receipt waits for a free bank only while the engine loads one version and another is staged, i.e. for
one load (seconds), during which the trainer's send waits too: a third bank would spare that wait at the
price of another whole version pinned per engine. A receipt never writes the staged bank, so the engine
always loads a whole version, the newest one received. On a host without CUDA the chunks are plain CPU
tensors, and the bytes they would pin are counted alike (:attr:`StagingRing.pinned_bytes`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

import torch

from megatron_credit.planning.pool import STAGING_BANKS, host_block_bytes
from megatron_credit.sources.bucket_bytes import unpack

FREE, RECEIVING, STAGED, LOADING = "free", "receiving", "staged", "loading"
WAIT_S = 0.25
"""How often a receipt waiting for a free bank looks whether the run stops."""


def host_chunk(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A ``uint8`` host tensor of :func:`host_block_bytes` (``nbytes``) bytes, pinned with ``pin``: the only
    place the ring pins. Asking for the allocator's whole block makes the tensor the size of what is held."""
    return torch.empty(host_block_bytes(nbytes), dtype=torch.uint8, pin_memory=pin)


class StagingRing:
    """The banks of host chunks of one engine leader (module docstring); thread-safe: the receiving thread
    writes (:meth:`begin`, :meth:`chunk`, :meth:`stage`, :meth:`abandon`), the generating thread reads
    (:meth:`take`)."""

    def __init__(self, *, pin: bool, banks: int = STAGING_BANKS):
        self.pin = pin
        self.chunks: list[list[torch.Tensor]] = [[] for _ in range(banks)]
        self.state = [FREE] * banks
        self.held: list[Optional[tuple[int, list[tuple[bytes, int]]]]] = [None] * banks  # (version, [(meta, bytes)])
        self.pinned_bytes = 0
        """Host bytes the chunks hold (pinned on a GPU; counted alike on a host without CUDA)."""
        self.cond = threading.Condition()

    @property
    def staged_version(self) -> Optional[int]:
        """The staged version, None when none is."""
        with self.cond:
            return next((self.held[b][0] for b, s in enumerate(self.state) if s == STAGED), None)

    # -- the receiving thread -----------------------------------------------------------------------
    def begin(self, stop: Callable[[], bool]) -> Optional[int]:
        """A free bank to receive the next version into, now marked receiving (one whose chunks exist
        first); waits while none is free (the engine loads one and another is staged). None when ``stop()``
        turned true while waiting."""
        while True:
            with self.cond:
                free = [b for b, s in enumerate(self.state) if s == FREE]
                if free:
                    bank = max(free, key=lambda b: len(self.chunks[b]))  # reuse before allocating
                    self.state[bank] = RECEIVING
                    return bank
            if stop():  # (outside the lock: it reads the store)
                return None
            with self.cond:
                self.cond.wait_for(lambda: FREE in self.state, timeout=WAIT_S)

    def chunk(self, bank: int, index: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of bucket ``index``'s chunk in ``bank`` (receiving), allocated the first time."""
        assert self.state[bank] == RECEIVING, self.state[bank]
        chunks = self.chunks[bank]
        if index == len(chunks):
            chunks.append(host_chunk(nbytes, pin=self.pin))
            self.pinned_bytes += chunks[-1].numel()
        elif chunks[index].numel() < nbytes:
            raise ValueError(f"weight bucket {index} of a version has {nbytes} bytes, more than the "
                             f"{chunks[index].numel()} its host chunk took from an earlier version: every version "
                             "must be bucketed alike (the same model, the same bucket_bytes)")
        return chunks[index][:nbytes]

    def stage(self, bank: int, version: int, buckets: list[tuple[bytes, int]]) -> None:
        """``bank`` holds ``version`` whole (``buckets``: each one's meta and byte count): staged, and an older
        staged version is dropped (its bank freed): the engine loads the newest complete version."""
        with self.cond:
            for b, s in enumerate(self.state):
                if s == STAGED:
                    self.state[b], self.held[b] = FREE, None
            self.state[bank], self.held[bank] = STAGED, (version, buckets)
            self.cond.notify_all()

    def abandon(self, bank: int) -> None:
        """A receipt that did not finish: ``bank`` is free again (nothing in it is read)."""
        with self.cond:
            self.state[bank], self.held[bank] = FREE, None
            self.cond.notify_all()

    # -- the generating thread ----------------------------------------------------------------------
    @contextlib.contextmanager
    def take(self) -> Iterator[Optional[tuple[int, Iterator[list]]]]:
        """The staged version as ``(version, buckets)`` (each bucket ``[(hf_name, tensor)]``, views of its
        chunk: copy them, never keep them), or None when none is staged. Its bank is loading until the block
        ends, then free (on a GPU once the device's copies from it are done)."""
        with self.cond:
            bank = next((b for b, s in enumerate(self.state) if s == STAGED), None)
            if bank is not None:
                self.state[bank] = LOADING
        if bank is None:
            yield None
            return
        version, buckets = self.held[bank]
        chunks = self.chunks[bank]
        try:
            yield version, (unpack(meta, chunks[i][:n]) for i, (meta, n) in enumerate(buckets))
        finally:
            if self.pin and torch.cuda.is_available():
                torch.cuda.synchronize()  # a copy still reading the chunk would see the next version
            with self.cond:
                self.state[bank], self.held[bank] = FREE, None
                self.cond.notify_all()
