"""Which adapter each token of one step's flat batch runs with: built once per step by the worker, handed to
every adapted projection through the attention metadata (the model only passes it on)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    """The step's tokens grouped by adapter slot: (slot, rows) for each slot in use, rows a slice when the
    slot's tokens are contiguous (one prompt chunk: the common case), else an index tensor. Tokens of the base
    model are in no group, so they cost nothing; a step with no adapter has no LoRABatch at all."""
    groups: list[tuple[int, slice | torch.Tensor]]

    @classmethod
    def from_spans(cls, spans: list[tuple[int, int, int]], device: torch.device) -> LoRABatch | None:
        """spans: (first row, end row, slot) of each sequence that runs with an adapter."""
        rows_of: dict[int, list[tuple[int, int]]] = {}
        for start, end, slot in spans:
            rows_of.setdefault(slot, []).append((start, end))
        groups = []
        for slot, ranges in rows_of.items():
            ranges.sort()
            contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            if contiguous:
                groups.append((slot, slice(ranges[0][0], ranges[-1][1])))
            else:
                rows = torch.cat([torch.arange(s, e) for s, e in ranges]).to(device)
                groups.append((slot, rows))
        return cls(groups) if groups else None

    def narrow(self, start: int, length: int) -> LoRABatch | None:
        """The groups of rows [start, start + length), renumbered from 0 (for a layer that runs its rows in
        parts)."""
        end, groups = start + length, []
        for slot, rows in self.groups:
            if isinstance(rows, slice):
                first, last = max(rows.start, start), min(rows.stop, end)
                if first < last:
                    groups.append((slot, slice(first - start, last - start)))
            else:
                inside = rows[(rows >= start) & (rows < end)]
                if len(inside):
                    groups.append((slot, inside - start))
        return LoRABatch(groups) if groups else None
