"""Shared-memory arenas: the allocator never overlaps live regions, and frees coalesce."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.shm import ALIGN, Allocator, Arena, create_arena_file


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


def test_arena_views_share_memory_across_mappings(tmp_path: Path) -> None:
    path = tmp_path / "a.arena"
    create_arena_file(path, 1 << 16)
    writer, reader = Arena(path, 1 << 16), Arena(path, 1 << 16)
    x = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    writer.view(128, torch.float32, (2, 3, 4)).copy_(x)
    assert torch.equal(reader.view(128, torch.float32, (2, 3, 4)), x)
    writer.close()
    reader.close()
