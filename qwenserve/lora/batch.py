"""Which adapter each token of one step's flat batch runs with: built once per step by the worker, handed to
every adapted projection through the attention metadata (the model only passes it on)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


SLICED_ROWS_PER_RANGE = 16  # an adapter's rows apart run as one group per range from this many rows a range


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


@dataclass
class LoRABatch:
    """The step's tokens grouped by adapter slot: (slot, rows), rows a slice when the slot's tokens are
    contiguous (one prompt chunk: the common case), one slice per range when they are long ranges apart, else an
    index tensor. Tokens of the base model are in no group, so they cost nothing; a step with no adapter has no
    LoRABatch at all."""
    groups: list[tuple[int, slice | torch.Tensor]]
    stacked: StackedRows | None = None  # set when the step runs its adapters stacked (ops.add_lora)

    @classmethod
    def from_spans(cls, spans: list[tuple[int, int, int]], device: torch.device,
                   stack: tuple[int, ...] = ()) -> LoRABatch | None:
        """spans: (first row, end row, slot) of each sequence that runs with an adapter. stack: the slots, in
        order, to run stacked (every slot of the spans among them); empty: by groups."""
        rows_of: dict[int, list[tuple[int, int]]] = {}
        for start, end, slot in spans:
            rows_of.setdefault(slot, []).append((start, end))
        groups = []
        for slot, ranges in rows_of.items():
            ranges = _merged(ranges)
            if len(ranges) == 1:
                groups.append((slot, slice(*ranges[0])))
            elif sum(e - s for s, e in ranges) >= SLICED_ROWS_PER_RANGE * len(ranges):
                # long prompt chunks apart: a group per chunk, since gathering and scattering many rows costs more
                # than the products (and the adapter's weights stay in cache between its chunks)
                groups += [(slot, slice(s, e)) for s, e in ranges]
            else:
                rows = torch.cat([torch.arange(s, e) for s, e in ranges]).to(device)
                groups.append((slot, rows))
        if not groups:
            return None
        return cls(groups, StackedRows.of(spans, stack, device) if stack else None)

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
        if not groups:
            return None
        if self.stacked is None:
            return LoRABatch(groups)
        spans = [(max(first, start) - start, min(last, end) - start, slot) for first, last, slot in self.stacked.spans
                 if first < end and last > start]
        return LoRABatch(groups, StackedRows.of(spans, self.stacked.slots, self.stacked.targets.device))


@dataclass
class StackedRows:
    """The step's rows laid out for the stacked products: slot i of `slots` takes rows gather[i * width:(i + 1) *
    width] (its own rows, then row 0 as padding up to the busiest slot's count); the products at positions `real`
    are added to rows `targets`."""
    slots: tuple[int, ...]
    spans: list[tuple[int, int, int]]
    gather: torch.Tensor
    real: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor  # each row's position in slots, -1 for the base model's, up to the last adapted row

    @classmethod
    def of(cls, spans: list[tuple[int, int, int]], slots: tuple[int, ...], device: torch.device) -> StackedRows:
        rows_of = {slot: [] for slot in slots}
        for start, end, slot in spans:
            rows_of[slot] += range(start, end)
        width = max(len(rows) for rows in rows_of.values())
        gather, real, targets = [], [], []
        for slot in slots:
            rows = rows_of[slot]
            real += range(len(gather), len(gather) + len(rows))
            targets += rows
            gather += rows + [0] * (width - len(rows))
        positions = [-1] * max(end for _, end, _ in spans)
        for start, end, slot in spans:
            positions[start:end] = [slots.index(slot)] * (end - start)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(slots, spans, as_tensor(gather), as_tensor(real), as_tensor(targets), as_tensor(positions))
