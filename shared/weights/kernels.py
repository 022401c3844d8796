"""The two loops of a weight delta, compiled with numba: finding what changed between two versions of a
tensor, and writing those changes into a tensor in place.

Each is one pass over the tensor's bits, without the GIL, compiled on first use (cached on disk where it can
be); `warm_up` compiles every specialization ahead of the first version. Arrays are flat integer views of the
tensors' bytes, so comparing compares bits: a NaN equals itself, -0.0 differs from 0.0.

More: docs/weight-sync.md#delta-kernels
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from pathlib import Path

import numba
import numpy as np

GAP_DTYPES = (np.uint8, np.uint16, np.int32, np.int64)


def _compiled(fn):
    """numba.njit without the GIL, cached on disk when numba has somewhere to write (else it refuses to decorate:
    a read-only root file system with no writable home), compiled anew in each process otherwise."""
    try:
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True)(fn)


@_compiled
def _count_changed(old, new):
    n = 0
    for i in range(old.size):
        n += old[i] != new[i]
    return n


@_compiled
def _emit_changes(old, new, old_words, new_words, lanes, gaps, vals):
    """Write each changed element's gap from the previous change (the first's: from 0) and its new bits; return
    (how many, the largest gap), or (-1, 0) when `gaps` has too few slots.

    The arrays are compared 8 bytes at a time (`*_words`: the same bytes as uint64, `lanes` elements to a word):
    at RL learning rates most words are unchanged and skipped whole. Within a changed word every lane is written
    at slot `j`, which only moves on past a change: no branch per element (changes fall at random, so it would
    be mispredicted often), at the cost of `lanes` spare slots. Elements past the last whole word are compared
    one by one."""
    width = 64 // lanes
    lane_mask = np.uint64((1 << width) - 1) if width < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
    j = 0
    last = 0
    largest = 0
    room = gaps.size - lanes
    for w in range(old_words.size):
        x = old_words[w] ^ new_words[w]
        if x == 0:
            continue
        if j > room:
            return -1, 0
        first = w * lanes
        for lane in range(lanes):
            changed = ((x >> np.uint64(width * lane)) & lane_mask) != 0
            i = first + lane
            gap = i - last
            gaps[j] = gap
            vals[j] = new[i]
            largest = max(largest, gap * changed)
            last = i if changed else last
            j += changed
    for i in range(old_words.size * lanes, old.size):
        if old[i] != new[i]:
            if j >= gaps.size:
                return -1, 0
            gap = i - last
            gaps[j] = gap
            vals[j] = new[i]
            largest = max(largest, gap)
            last = i
            j += 1
    return j, largest


def changes(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(gaps, values) of the elements where `new` differs from `old` (same dtype and size), or None when none
    does. gaps[k] is the distance of change k from change k-1 (change 0: from index 0), in the smallest of
    GAP_DTYPES that holds every gap; values are the new bits."""
    warm_up()
    lanes = 8 // new.itemsize
    whole = old.size - old.size % lanes
    old_words, new_words = old[:whole].view(np.uint64), new[:whole].view(np.uint64)
    gap_dtype = np.uint32 if old.size <= np.iinfo(np.uint32).max else np.int64
    slots = old.size // 8 + lanes + 1  # enough at RL learning rates (a few percent change)
    while True:
        gaps, vals = np.empty(slots, gap_dtype), np.empty(slots, new.dtype)
        n, largest = _emit_changes(old, new, old_words, new_words, lanes, gaps, vals)
        if n >= 0:
            break
        slots = _count_changed(old, new) + lanes + 1  # many changed: count them, then one more pass
    if n == 0:
        return None
    narrow = next(d for d in GAP_DTYPES if largest <= np.iinfo(d).max)
    return gaps[:n].astype(narrow), vals[:n]


@_compiled
def _patch(bits, gaps, vals, undo):
    """bits[positions] = vals, positions being the running sums of `gaps`; the bits each write replaces go to
    `undo`. Stops at the first position outside `bits` (or before the previous one) and returns how many writes
    were made: len(gaps) when all were."""
    pos = -1
    for k in range(gaps.size):
        nxt = (0 if pos < 0 else pos) + np.int64(gaps[k])
        if nxt >= bits.size or nxt < 0 or (k > 0 and nxt <= pos):
            return k
        pos = nxt
        undo[k] = bits[pos]
        bits[pos] = vals[k]
    return gaps.size


@_compiled
def _unpatch(bits, gaps, undo, written):
    """Undo the first `written` writes of `_patch`."""
    pos = 0
    for k in range(written):
        pos += np.int64(gaps[k])
        bits[pos] = undo[k]


class PatchError(ValueError):
    """A delta's positions do not fit the tensor: out of range, or not increasing."""


def patch(bits: np.ndarray, gaps: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """Write `vals` into `bits` (a writable flat view) at the positions `gaps` encode (see `changes`); return
    what they replaced, for `unpatch`. PatchError, with `bits` unchanged, when a position is out of range or
    not after the one before (a malformed delta), or when the lengths differ."""
    if gaps.dtype not in GAP_DTYPES or gaps.ndim != 1:
        widths = "/".join(np.dtype(d).name for d in GAP_DTYPES)
        raise PatchError(f"positions are {gaps.dtype} of shape {gaps.shape}, not 1-d {widths}")
    if gaps.shape != vals.shape or vals.dtype != bits.dtype:
        raise PatchError(f"{gaps.size} positions for {vals.size} values of {vals.dtype} (tensor: {bits.dtype})")
    warm_up()
    undo = np.empty_like(vals)
    written = _patch(bits, gaps, vals, undo)
    if written < gaps.size:
        _unpatch(bits, gaps, undo, written)
        raise PatchError(f"change {written} of {gaps.size} falls outside the tensor's {bits.size} elements or "
                         "not after the change before it")
    return undo


def unpatch(bits: np.ndarray, gaps: np.ndarray, undo: np.ndarray) -> None:
    """Put back what `patch` replaced."""
    warm_up()
    _unpatch(bits, gaps, undo, gaps.size)


ELEMENT_DTYPES = (np.int8, np.int16, np.int32, np.int64)  # the bits of fp8, bf16/fp16, fp32, fp64 weights
_LOCK_FILE = Path(tempfile.gettempdir()) / "flywheel-delta-kernels.lock"
_ready = threading.Event()
_ready_lock = threading.Lock()


def warm_up() -> None:
    """Load every kernel this module's functions can call (each element width, each gap width) from numba's disk
    cache, or compile and save it, once per process; `changes`, `patch` and `unpatch` wait for it.

    Every specialization is made here, holding a lock file, and nowhere else: numba's cache is not safe when two
    processes save into it at once (each reads the index, both give their entry the same data file name, and
    the index can end up naming the other's machine code), and many processes share one cache on a developer's
    or CI's machine. Taken in turn, the first process compiles and saves (a few seconds, once per machine and
    numba version) and the others load."""
    if _ready.is_set():
        return
    with _ready_lock:
        if _ready.is_set():
            return
        with _cache_lock():
            for dtype in ELEMENT_DTYPES:
                old = np.zeros(64, dtype)
                new = old.copy()
                new[[3, 63]] = 1
                lanes = 8 // old.itemsize
                _count_changed(old, new)
                for gap_dtype in (np.uint32, np.int64):  # what `changes` writes gaps into
                    _emit_changes(old, new, old.view(np.uint64), new.view(np.uint64), lanes,
                                  np.empty(old.size + lanes, gap_dtype), np.empty(old.size + lanes, dtype))
                for gap_dtype in GAP_DTYPES:
                    gaps, vals = np.array([3, 60], gap_dtype), np.ones(2, dtype)
                    undo = np.empty_like(vals)
                    _patch(old, gaps, vals, undo)
                    _unpatch(old, gaps, undo, 2)
        _ready.set()


@contextlib.contextmanager
def _cache_lock():
    """An exclusive lock on _LOCK_FILE, shared by every process of this machine; without it when the file
    cannot be opened (no writable temp folder: then numba has no cache to write either)."""
    try:
        fd = os.open(_LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def warm_up_in_background() -> threading.Thread:
    """`warm_up` on a daemon thread: for a service to call when it starts (a first use meanwhile waits for it)."""
    thread = threading.Thread(target=warm_up, name="delta-kernels-warm-up", daemon=True)
    thread.start()
    return thread


def changes_on_device(old, new) -> tuple[np.ndarray, np.ndarray] | None:
    """`changes` computed where the tensors live (torch; a CUDA trainer diffs next to its weights and copies
    only the changes to the host): the same (gaps, values) encoding as `changes` of the integer views of the
    same bits (shared/weights/delta.py compares bits as integers). `old` and `new`: torch tensors of one dtype and
    size."""
    import torch

    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    o, n = old.reshape(-1).view(bits), new.reshape(-1).view(bits)
    positions = (o != n).nonzero().squeeze(1)
    if positions.numel() == 0:
        return None
    gaps = torch.diff(positions, prepend=positions.new_zeros(1))
    largest = int(gaps.max())
    narrow = next(d for d in GAP_DTYPES if largest <= np.iinfo(d).max)
    values = n[positions].cpu().numpy()
    return gaps.cpu().numpy().astype(narrow), values

