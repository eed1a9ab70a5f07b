"""Turns a scheduled batch into one flat forward pass: token ids, positions, slot mapping and block tables
(no padding to the longest prompt), then logits for the rows that need them. Only the last position of
each sequence that takes a token goes through the LM head (plus every prompt position of a request that
asked for prompt logprobs)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .kernels import use_cpu_kernels
from .models.qwen2 import Qwen2ForCausalLM
from .paged_attention import DecodeGroup, PagedBatch, PagedKVCache, PrefillSpan
from .scheduler import ScheduledBatch
from .sequence import Sequence

MAX_DECODE_GROUPS = 4


@dataclass
class ModelOutput:
    sampling_seqs: list[Sequence]  # sequences that reached their last known token: they take a new one
    logits: torch.Tensor  # [len(sampling_seqs), vocab], model dtype
    # (sequence, logits [n, vocab] of its prompt chunk's positions, position of the chunk's first token)
    prompt_logits: list[tuple[Sequence, torch.Tensor, int]] = field(default_factory=list)


@torch.inference_mode()
def full_logits(model: Qwen2ForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence ([T, vocab], float32) from a single prefill, with a cache of
    its own: for scoring, validation and tests."""
    device = model.device
    attn = model.model.layers[0].self_attn
    n, block = len(token_ids), 16
    cache = PagedKVCache(len(model.model.layers), -(-n // block), block, attn.num_kv_heads, attn.head_dim,
                         model.dtype, device)
    positions = torch.arange(n, device=device)
    batch = PagedBatch(cache, positions, [], [PrefillSpan(0, n, None, n)])
    hidden = model(torch.tensor(token_ids, device=device), positions, batch)
    return model.compute_logits(hidden).float()


class ModelRunner:
    def __init__(self, model: Qwen2ForCausalLM, cache: PagedKVCache, device: torch.device | str = "cpu"):
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.device = torch.device(device)
        # the CPU kernel reads every decode sequence in place at its own length: no grouping or masks needed
        self.decode_kernel = use_cpu_kernels(cache.k[0]) is not None

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.as_tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, PagedBatch, list, list]:
        bs = self.block_size
        ids, positions, slots = [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        sample_rows, sampling_seqs, prompt_rows = [], [], []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table[:-(-end // bs)], dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(PrefillSpan(row, row + n, None if start == 0 else self._tensor(table), end))
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
                sampling_seqs.append(seq)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                prompt_rows.append((seq, row, min(end, seq.num_prompt_tokens) - start, start))
            row += n

        decode = self._decode_groups(decode_rows, decode_tables, decode_lens, row)
        paged = PagedBatch(self.cache, self._tensor(np.concatenate(slots)), decode, prefills)
        return (self._tensor(ids), self._tensor(np.concatenate(positions)), paged,
                (sample_rows, sampling_seqs), prompt_rows)

    def _decode_groups(self, rows: list[int], tables: list[np.ndarray], lens: list[int], num_rows: int):
        """Decode tokens as batched attentions. The CPU kernel takes them all in one group, each sequence read at
        its own length. Otherwise up to MAX_DECODE_GROUPS groups of similar context length, each padded (gathered
        and masked) only to its own longest context."""
        if not rows:
            return []
        lens_arr = np.asarray(lens)
        if not self.decode_kernel and len(rows) >= 2 * MAX_DECODE_GROUPS and lens_arr.max() > 2 * lens_arr.min():
            groups = np.array_split(np.argsort(lens_arr, kind="stable"), MAX_DECODE_GROUPS)
        else:
            groups = [np.arange(len(rows))]
        bs = self.block_size
        out = []
        for members in groups:
            member_lens = lens_arr[members]
            longest = int(member_lens.max())
            block_tables = np.zeros((len(members), -(-longest // bs)), dtype=np.int64)
            for i, m in enumerate(members):
                block_tables[i, :len(tables[m])] = tables[m]
            mask = context_lens = None
            if self.decode_kernel:
                context_lens = self._tensor(member_lens)
            elif (member_lens != longest).any():
                mask = self._tensor(np.arange(longest)[None, :] < member_lens[:, None], torch.bool)[:, None, None, :]
            # one group holding the whole batch, in row order: its output needs no scatter
            index = None if len(groups) == 1 and len(rows) == num_rows else self._tensor(np.asarray(rows)[members])
            out.append(DecodeGroup(index, self._tensor(block_tables), longest, mask, context_lens))
        return out

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        input_ids, positions, paged, (sample_rows, sampling_seqs), prompt_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, paged)
        logits = self.model.compute_logits(hidden[self._tensor(sample_rows)])
        out = ModelOutput(sampling_seqs, logits.cpu())
        for seq, row, count, first_pos in prompt_rows:
            out.prompt_logits.append((seq, self.model.compute_logits(hidden[row:row + count]).float().cpu(),
                                      first_pos))
        return out
