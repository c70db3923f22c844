"""CascadePlan: the flat index arrays that cascade (shared-prefix) decode reads, built on the host.

ForwardBatch.prefix_groups lists (prefix_len, [sequence indices]) whose first prefix_len slots are the same
pool slots. The plan keeps the groups worth sharing and cuts each group's sequences into tiles of at most
`queries_per_tile` sequences; one tile's queries (times the query heads of one kv head) form the rows of
one matrix product against a chunk of the shared prefix, so the prefix K/V is read once per tile instead of
once per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CascadePlan:
    group_prefix_lens: torch.Tensor  # [G] int32, shared prefix length of each group
    group_lead_seq: torch.Tensor  # [G] int32, a member sequence whose req_to_token row gives the prefix slots
    group_seq_start: torch.Tensor  # [G + 1] int32, group g's sequences are group_seq_ids[start[g]:start[g+1]]
    group_seq_ids: torch.Tensor  # [N] int32, sequence indices, grouped
    tile_group: torch.Tensor  # [num_tiles] int32
    tile_seq_start: torch.Tensor  # [num_tiles] int32, offset of the tile's first sequence in group_seq_ids
    tile_num_seqs: torch.Tensor  # [num_tiles] int32, 1..queries_per_tile
    suffix_start: torch.Tensor  # [B] int32, first position not covered by the sequence's group (0 = ungrouped)
    queries_per_tile: int
    num_tiles: int
    max_prefix_len: int  # longest shared prefix (host value, for choosing split counts)
    max_suffix_len: int  # longest per-sequence remainder, ungrouped sequences counted whole
    # Tiles to plan split counts for, when num_tiles counts padding tiles (a plan padded for CUDA graphs):
    # the real tiles of a full bucket, so few real tiles still get enough splits. None = num_tiles.
    split_tiles: int | None = None


def plan_cascade(
    prefix_groups: list[tuple[int, list[int]]] | None,
    seq_lens_cpu: list[int],
    device: torch.device | str,
    queries_per_tile: int = 16,
    min_prefix_len: int = 1,
    min_group_size: int = 2,
) -> CascadePlan | None:
    """Validate prefix_groups and build the plan; None when no group is worth sharing (too short a prefix
    or too few sequences). Raises ValueError on groups that contradict the batch (prefix longer than a
    member's sequence, a sequence in two groups, an index out of range)."""
    lists = plan_lists(prefix_groups, seq_lens_cpu, queries_per_tile, min_prefix_len, min_group_size)
    if lists is None:
        return None
    parts = [lists[name] for name in PLAN_FIELDS]
    # One host->device copy for all arrays; the fields are views into it.
    flat = torch.tensor([x for part in parts for x in part], dtype=torch.int32).to(device, non_blocking=True)
    views, offset = [], 0
    for part in parts:
        views.append(flat[offset : offset + len(part)])
        offset += len(part)
    return CascadePlan(
        *views,
        queries_per_tile=queries_per_tile,
        num_tiles=len(lists["tile_group"]),
        max_prefix_len=max(lists["group_prefix_lens"]),
        max_suffix_len=max(n - p for n, p in zip(seq_lens_cpu, lists["suffix_start"])),
    )


PLAN_FIELDS = ("group_prefix_lens", "group_lead_seq", "group_seq_start", "group_seq_ids", "tile_group",
               "tile_seq_start", "tile_num_seqs", "suffix_start")


def plan_lists(
    prefix_groups: list[tuple[int, list[int]]] | None,
    seq_lens_cpu: list[int],
    queries_per_tile: int = 16,
    min_prefix_len: int = 1,
    min_group_size: int = 2,
    max_groups: int | None = None,
) -> dict[str, list[int]] | None:
    """The plan's arrays as host lists (PLAN_FIELDS), or None when no group is worth sharing. With
    max_groups, only that many groups are kept (the ones sharing the most keys); the others' sequences
    run ungrouped, which gives the same result."""
    if not prefix_groups:
        return None
    batch_size = len(seq_lens_cpu)
    seen: set[int] = set()
    kept: list[tuple[int, list[int]]] = []
    for prefix_len, members in prefix_groups:
        for s in members:
            if not 0 <= s < batch_size:
                raise ValueError(f"prefix group names sequence {s}, batch has {batch_size}")
            if s in seen:
                raise ValueError(f"sequence {s} is in two prefix groups")
            seen.add(s)
            if prefix_len > seq_lens_cpu[s]:
                raise ValueError(f"prefix_len {prefix_len} exceeds sequence {s}'s length {seq_lens_cpu[s]}")
        if prefix_len >= min_prefix_len and len(members) >= min_group_size:
            kept.append((prefix_len, list(members)))
    if max_groups is not None and len(kept) > max_groups:
        kept = sorted(kept, key=lambda g: -g[0] * (len(g[1]) - 1))[:max_groups]
    if not kept:
        return None

    prefix_lens, leads, seq_start, seq_ids = [], [], [0], []
    tile_group, tile_seq_start, tile_num_seqs = [], [], []
    suffix_start = [0] * batch_size
    for g, (prefix_len, members) in enumerate(kept):
        prefix_lens.append(prefix_len)
        leads.append(members[0])
        for t in range(0, len(members), queries_per_tile):
            tile_group.append(g)
            tile_seq_start.append(len(seq_ids) + t)
            tile_num_seqs.append(min(queries_per_tile, len(members) - t))
        seq_ids.extend(members)
        seq_start.append(len(seq_ids))
        for s in members:
            suffix_start[s] = prefix_len
    return {"group_prefix_lens": prefix_lens, "group_lead_seq": leads, "group_seq_start": seq_start,
            "group_seq_ids": seq_ids, "tile_group": tile_group, "tile_seq_start": tile_seq_start,
            "tile_num_seqs": tile_num_seqs, "suffix_start": suffix_start}


def padded_sizes(batch_size: int, max_groups: int, queries_per_tile: int) -> dict[str, int]:
    """Array lengths of a plan padded for a CUDA graph of batch_size rows and at most max_groups groups:
    every plan of such a batch fits (tiles <= cdiv(batch, q) + groups)."""
    tiles = -(-batch_size // queries_per_tile) + max_groups
    return {"group_prefix_lens": max_groups, "group_lead_seq": max_groups, "group_seq_start": max_groups + 1,
            "group_seq_ids": batch_size, "tile_group": tiles, "tile_seq_start": tiles, "tile_num_seqs": tiles,
            "suffix_start": batch_size}


def pad_lists(lists: dict[str, list[int]], sizes: dict[str, int]) -> list[int]:
    """Concatenate the plan's arrays, each padded with zeros to its size (PLAN_FIELDS order). Zero is the
    padding of every field: a tile with tile_num_seqs 0 does nothing, suffix_start 0 = ungrouped."""
    flat: list[int] = []
    for name in PLAN_FIELDS:
        part = lists[name]
        if len(part) > sizes[name]:
            raise ValueError(f"plan field {name} has {len(part)} entries, the padded plan holds {sizes[name]}")
        flat.extend(part)
        flat.extend([0] * (sizes[name] - len(part)))
    return flat
