"""Shared-memory arenas: how request tensors cross from a front end to the engine without a copy.

Each front-end process owns one :class:`Arena`, a file in ``/dev/shm`` (tmpfs; pages are only
backed once touched) created by the supervisor and mapped by that front end and by the engine. A
front end allocates a region per request (:class:`Allocator`, first fit), decodes the request's
images straight into it as uint8 ``(n, Cin, H, W)``, and sends the engine only the region's
offset, dtype and shape over its control socket. The engine reads the region in place when it
assembles a batch; the front end frees the region when the engine's answer for that request
arrives (the engine is then done with it).

The arena's first :data:`HEADER` bytes are not allocated: they hold the front end's *arrival
count* (int64), the number of requests it is decoding for the engine and has not sent yet. The
front end is its only writer; the engine reads it to decide whether a batch is worth holding for a
moment (:class:`service.engine.batcher.Batcher`, ``batch_wait="adaptive"``).

Why this channel (a design argument, not a side-by-side measurement): a tensor through
``torch.multiprocessing`` costs a file-descriptor handshake per tensor, a plain
``multiprocessing.Queue`` a pickle and a copy; a mapped region costs the write that decoding does
anyway plus a ~100-byte control message per request.
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
from pathlib import Path

import numpy as np

#: Region alignment in bytes (float32 views need 4; 64 keeps regions on cache lines).
ALIGN = 64
#: Bytes at the start of every arena kept for its header (the arrival count); never allocated.
HEADER = ALIGN
#: The dtypes requests travel in, by name (``np.dtype(name)`` costs ~0.5 µs per call).
DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in ("uint8", "float32")}


def shm_dir() -> Path:
    """``/dev/shm`` when it is a writable directory (tmpfs), else the temp directory."""
    d = Path("/dev/shm")
    if d.is_dir() and os.access(d, os.W_OK):
        return d
    import tempfile

    return Path(tempfile.gettempdir())


def create_arena_file(path: Path, size: int) -> None:
    """Create a new sparse arena file of ``size`` bytes at ``path``, readable by this user only.

    ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600: a file or symlink already there is an error,
    never opened. ``open(path, "wb")`` followed a symlink planted at the (predictable) name: the
    server truncated the link's target and wrote 64 MiB of zeros into it, and the 0644 file let
    other local users read request pixels.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


#: The supervisor's arena files (``vge-<its pid>-<front end>-<random>.arena``): what
#: :func:`service.common.process.remove_stale` looks for (by their locks, not their pids).
ARENA_PATTERN = re.compile(r"vge-\d+-\d+-[0-9a-f]{16}\.arena")


def new_arena_file(size: int, tag: str, base: Path | None = None) -> Path:
    """A new arena file in ``base`` (default :func:`shm_dir`) with an unpredictable name,
    ``vge-<tag>-<16 random hex>.arena`` (:func:`create_arena_file`)."""
    import secrets

    path = (base or shm_dir()) / f"vge-{tag}-{secrets.token_hex(8)}.arena"
    create_arena_file(path, size)
    return path


class Arena:
    """A shared file mapped read-write; :meth:`array` gives NumPy arrays over byte ranges of it."""

    def __init__(self, path: str | Path, size: int) -> None:
        self.path = str(path)
        self.size = int(size)
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self._header = memoryview(self._mm)[:8].cast("q")  # (1,) int64: the arrival count

    @property
    def arriving(self) -> int:
        """Requests the owning front end is decoding and has not sent to the engine yet."""
        return self._header[0]

    @arriving.setter
    def arriving(self, n: int) -> None:
        self._header[0] = n

    def array(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """A NumPy array of ``dtype`` and ``shape`` over the bytes at ``offset`` (no copy).

        Both sides use it: a front end decodes into its region through one, the engine reads the
        region through another, and its compute thread gathers a batch's arrays with one
        ``np.concatenate`` (``Predictor.run``). NumPy makes the view without releasing the GIL,
        where a torch view took three torch calls (~4 µs), each handing the GIL to the engine's
        compute thread, which may keep it for a whole switch interval: on an H100 host at 5,000
        req/s the torch view took 17 % of the engine's CPU samples. The engine makes one per
        request on its event loop, so the dtype is looked up once per name and the view is one
        ``np.ndarray`` call (0.8 against 1.9 µs per view on the 2-core box). Each array keeps the
        mapping alive after :meth:`close`.
        """
        dt = DTYPES.get(dtype) or np.dtype(dtype)
        nbytes = nbytes_of(dt, shape)
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"region [{offset}, {offset + nbytes}) outside the arena ({self.size})"
            )
        return np.ndarray(shape, dt, self._mm, offset)  # one call: frombuffer + reshape took two

    def close(self) -> None:
        """Drop this arena's references to the mapping; it is unmapped once no array views it.

        Never ``mmap.close()`` here: the engine closes a front end's arena when that front end goes
        away, possibly while a batch holding arrays of it still computes (a read of unmapped memory
        would kill the engine). Each array keeps the ``mmap`` object alive; the last one unmaps it.
        """
        self._header.release()
        del self._mm


def nbytes_of(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a ``dtype`` array of ``shape``; a negative dimension is refused (numpy would read
    a negative count as "the rest of the buffer")."""
    n = dtype.itemsize
    for s in shape:
        s = int(s)
        if s < 0:
            raise ValueError(f"negative dimension in shape {shape}")
        n *= s
    return n


class Allocator:
    """First-fit allocator of aligned regions in ``[start, size)``; free regions coalesce.

    Used by one event loop only (no locking). :meth:`allocate` returns ``None`` when no free region
    is large enough; the caller turns that into back-pressure (503).
    """

    def __init__(self, size: int, start: int = 0) -> None:
        self.size = size
        self.start = start
        self._starts: list[int] = [start]  # free regions, sorted by start
        self._lengths: dict[int, int] = {start: size - start}  # free region start -> length
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def allocate(self, nbytes: int) -> int | None:
        need = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= need:
                del self._starts[i]
                del self._lengths[start]
                if length > need:
                    rest = start + need
                    self._starts.insert(i, rest)
                    self._lengths[rest] = length - need
                self._used[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        need = self._used.pop(offset, None)
        if need is None:
            return
        i = bisect.bisect_left(self._starts, offset)
        start, length = offset, need
        if i < len(self._starts) and self._starts[i] == offset + need:  # merge with the next
            nxt = self._starts.pop(i)
            length += self._lengths.pop(nxt)
        if i > 0:  # merge with the previous
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == offset:
                self._lengths[prev] += length
                return
        self._starts.insert(i, start)
        self._lengths[start] = length
