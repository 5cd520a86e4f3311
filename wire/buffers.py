"""Byte buffers for large payloads: allocation that is cheap to touch, and copies that use every
core torch is allowed.

Why: at the sizes of a prefill (32 MiB of hidden states), first-touching freshly allocated 4 KiB
pages costs more than the copy itself; numpy asks the kernel for transparent huge pages
(madvise) on large allocations, which torch's and CPython's allocators do not. And a copy through
torch runs on torch's intra-op threads where memoryview assignment runs on one core.
"""

from __future__ import annotations

import numpy as np
import torch

PARALLEL_COPY = 1 << 20
"""Copies at least this long go through torch (threads); shorter ones are faster in one core."""


HUGE_PAGE_ALLOCATION = 1 << 20
"""Buffers at least this big come from numpy (huge pages); smaller ones from the usual allocator."""


def allocate(size: int) -> memoryview:
    """A writable, uninitialised buffer of `size` bytes (numpy-allocated)."""
    return np.empty(size, np.uint8).data


def freeze(buffer: memoryview) -> memoryview:
    """`buffer` (from `allocate`) made immutable: a read-only view that `is_immutable` accepts.

    The caller must hold no other view of it. Receivers may then keep views into it instead of
    copying (see FrameDecoder.receive_data).
    """
    array = buffer.obj
    assert isinstance(array, np.ndarray) and array.base is None
    array.flags.writeable = False
    return array.data


def is_immutable(view: memoryview) -> bool:
    """True when nobody can change the bytes behind `view`: a bytes object or a frozen buffer."""
    owner = view.obj
    if isinstance(owner, bytes):
        return True
    return (
        view.readonly
        and isinstance(owner, np.ndarray)
        and not owner.flags.writeable
        and owner.base is None
    )


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src for two flat byte views of equal length (dst writable)."""
    if len(src) >= PARALLEL_COPY and not src.readonly:
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
    else:
        dst[:] = src
