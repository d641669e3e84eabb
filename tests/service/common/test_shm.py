"""Shared-memory arenas: the allocator never overlaps live regions, and frees coalesce."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.common.shm import ALIGN, HEADER, Allocator, Arena, create_arena_file


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), min_size=1, max_size=60))
def test_live_regions_never_overlap_and_everything_frees(ops: list[tuple[bool, int]]) -> None:
    size = 64 * 1024
    alloc = Allocator(size)
    live: dict[int, int] = {}
    for free_one, n in ops:
        if free_one and live:
            off = next(iter(live))
            alloc.free(off)
            del live[off]
            continue
        off = alloc.allocate(n)
        if off is None:
            assert sum(-(-v // ALIGN) * ALIGN for v in live.values()) + n > size - ALIGN * 60
            continue
        assert off % ALIGN == 0 and off + n <= size
        for o, m in live.items():
            assert off + n <= o or o + m <= off, "overlap"
        live[off] = n
    for off in list(live):
        alloc.free(off)
    assert alloc.used_bytes == 0
    assert alloc.allocate(size) == 0  # fully coalesced again


def test_arrays_share_memory_across_mappings(tmp_path: Path) -> None:
    path = tmp_path / "a.arena"
    create_arena_file(path, 1 << 16)
    writer, reader = Arena(path, 1 << 16), Arena(path, 1 << 16)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.copyto(writer.array(128, "float32", (2, 3, 4)), x)
    assert np.array_equal(reader.array(128, "float32", (2, 3, 4)), x)
    writer.close()
    reader.close()


def test_the_engine_reads_what_the_front_end_wrote_without_a_copy(tmp_path: Path) -> None:
    """Front end and engine each see the region as a NumPy array over their own mapping; the
    compute thread's ``torch.as_tensor`` of the engine's array shares its memory."""
    path = tmp_path / "a.arena"
    create_arena_file(path, 1 << 16)
    writer, reader = Arena(path, 1 << 16), Arena(path, 1 << 16)
    x = np.arange(2 * 1 * 4 * 4, dtype=np.uint8).reshape(2, 1, 4, 4)
    np.copyto(writer.array(192, "uint8", (2, 1, 4, 4)), x)
    arr = reader.array(192, "uint8", (2, 1, 4, 4))
    assert arr.dtype == np.uint8 and arr.shape == (2, 1, 4, 4)
    t = torch.as_tensor(arr)
    assert torch.equal(t, torch.from_numpy(x))
    writer.array(192, "uint8", (1,))[0] = 255  # a later write shows through: no copy
    assert int(t[0, 0, 0, 0]) == 255
    f = reader.array(256, "float32", (3,))
    np.copyto(writer.array(256, "float32", (3,)), [0.5, 1.5, -2.0])
    assert f.tolist() == [0.5, 1.5, -2.0]
    with pytest.raises(ValueError, match="outside the arena"):
        reader.array((1 << 16) - 8, "float32", (4,))
    with pytest.raises(ValueError, match="outside the arena"):
        reader.array(-64, "uint8", (1,))
    with pytest.raises(ValueError, match="negative dimension"):
        reader.array(192, "uint8", (-1, 1, 4, 4))
    writer.close()
    reader.close()  # the arrays keep the mapping: still readable (a batch may hold them)
    gc.collect()
    assert np.array_equal(arr[1], x[1]) and f.tolist() == [0.5, 1.5, -2.0]


def test_a_closed_arena_stays_readable_through_live_arrays(tmp_path: Path) -> None:
    """The engine closes a departed front end's arena while a batch may still read arrays of it:
    the mapping must outlive ``close`` until the last array is gone (an unmapped read is a crash)."""
    path = tmp_path / "a.arena"
    create_arena_file(path, 1 << 16)
    arena = Arena(path, 1 << 16)
    view = arena.array(HEADER, "int64", (4,))
    np.copyto(view, [1, 2, 3, 4])
    arena.close()
    del arena
    gc.collect()
    assert view.tolist() == [1, 2, 3, 4]


def test_the_header_carries_the_arrival_count_and_is_never_allocated(tmp_path: Path) -> None:
    path = tmp_path / "a.arena"
    create_arena_file(path, 1 << 16)
    front, engine = Arena(path, 1 << 16), Arena(path, 1 << 16)
    assert engine.arriving == 0
    front.arriving += 3
    front.arriving -= 1
    assert engine.arriving == 2
    alloc = Allocator(1 << 16, start=HEADER)
    offsets = [alloc.allocate(1 << 12) for _ in range(15)]
    assert min(offsets) == HEADER  # type: ignore[type-var]
    assert alloc.allocate(1 << 12) is None  # 16 pages minus the header do not fit a 16th
    for offset in offsets:
        alloc.free(offset)  # type: ignore[arg-type]
    assert alloc.allocate(1) == HEADER
    front.close()
    engine.close()


def test_arena_files_are_private_new_files_with_unpredictable_names(tmp_path: Path) -> None:
    """Issue 28: ``open(path, "wb")`` followed a symlink planted at the predictable
    ``vge-<pid>-<i>.arena`` (its target truncated and zeroed) and left the file 0644."""
    import os
    import stat

    from service.common.shm import new_arena_file

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "planted.arena"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        create_arena_file(link, 1 << 16)  # a symlink there: refused, not followed
    plain = tmp_path / "plain.arena"
    plain.write_bytes(b"x")
    with pytest.raises(FileExistsError):
        create_arena_file(plain, 1 << 16)  # an existing file: refused, not reset
    assert victim.read_bytes() == b"precious" and plain.read_bytes() == b"x"
    old = os.umask(0)
    try:
        a, b = new_arena_file(1 << 16, "7-0", tmp_path), new_arena_file(1 << 16, "7-0", tmp_path)
    finally:
        os.umask(old)
    assert a != b and a.name.startswith("vge-7-0-") and len(a.stem) == len("vge-7-0-") + 16
    assert stat.S_IMODE(a.stat().st_mode) == 0o600 and a.stat().st_size == 1 << 16
