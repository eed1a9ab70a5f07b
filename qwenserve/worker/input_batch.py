"""The worker's copy of every sequence it runs (`SequenceState`: tokens, block table, sampling state), kept
across steps from the scheduler's deltas, and the flat batch built from them each step: token ids,
positions, cache slots and attention metadata, with no padding to the longest prompt."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from qwenserve.core.step import SchedulerOutput
from qwenserve.model.layers.attention import AttentionMetadata, DecodeGroup, PagedKVCache, PrefillSpan
from qwenserve.sample.sampling_params import SamplingParams

MAX_DECODE_GROUPS = 4


@dataclass(eq=False)
class SequenceState:
    seq_id: int
    token_ids: list[int]  # prompt and every token sampled so far
    num_prompt_tokens: int
    params: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None  # the request's own RNG when seeded; survives preemption

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class PromptChunk:
    """Rows of a prompt chunk whose request asked for prompt logprobs."""
    seq: SequenceState
    first_row: int
    first_position: int
    num_rows: int


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # rows whose logits pick each sampling sequence's next token(s)
    sampling_seqs: list[SequenceState]  # sequences that reached their last known token: they take a new one
    prompt_chunks: list[PromptChunk] = field(default_factory=list)
    # per sampling sequence, the drafts it verifies (speculative decoding): its sample rows are its last
    # len(drafts) + 1, one after its last known token and one after each draft
    draft_token_ids: list[list[int]] = field(default_factory=list)


class InputBatch:
    def __init__(self, block_size: int, device: torch.device, decode_kernel: bool):
        self.block_size = block_size
        self.device = device
        # the CPU kernel reads every decode sequence in place at its own length: no grouping or masks needed
        self.decode_kernel = decode_kernel
        self.seqs: dict[int, SequenceState] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's deltas: forget ended sequences, add new ones, extend the others' block tables."""
        for seq_id in scheduler_output.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in scheduler_output.new_seqs:
            p = new.params
            generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            self.seqs[new.seq_id] = SequenceState(new.seq_id, list(new.token_ids), new.num_prompt_tokens, p,
                                                  list(new.block_ids), new.num_computed_tokens, generator)
        for cached in scheduler_output.cached_seqs:
            seq = self.seqs[cached.seq_id]
            seq.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                seq.block_table = list(cached.new_block_ids)
            else:
                seq.block_table.extend(cached.new_block_ids)
            seq.num_computed_tokens = cached.num_computed_tokens

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.as_tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, scheduler_output: SchedulerOutput, kv_cache: PagedKVCache) -> ModelInputs:
        bs = self.block_size
        ids, positions, slots = [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        sample_rows, sampling_seqs, prompt_chunks, drafts_of = [], [], [], []
        row = 0
        for seq_id, n in scheduler_output.num_scheduled_tokens.items():
            seq = self.seqs[seq_id]
            drafts = scheduler_output.spec_token_ids.get(seq_id, [])
            tokens = seq.token_ids + drafts if drafts else seq.token_ids
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(tokens[start:end])
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
            if end == len(tokens):
                sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
                sampling_seqs.append(seq)
                drafts_of.append(drafts)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                prompt_chunks.append(PromptChunk(seq, row, start, min(end, seq.num_prompt_tokens) - start))
            row += n

        decode = self._decode_groups(decode_rows, decode_tables, decode_lens, row)
        metadata = AttentionMetadata(kv_cache, self._tensor(np.concatenate(slots)), decode, prefills)
        return ModelInputs(self._tensor(ids), self._tensor(np.concatenate(positions)), metadata,
                           self._tensor(sample_rows), sampling_seqs, prompt_chunks, drafts_of)

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
