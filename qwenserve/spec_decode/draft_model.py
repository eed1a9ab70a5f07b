"""Draft-model proposals: a small model of the target's tokenizer (Qwen2.5-0.5B for a larger Qwen2.5) runs in the
worker that samples and proposes each speculating sequence's next k tokens greedily; the target verifies them.

Its KV cache is tensors of its own (its layers, kv heads and head dim) indexed by the target's block ids: a
sequence's block table addresses both caches, so the scheduler's one allocator serves the draft too (no second
pool to size, to run out of, to preempt from or to free), and each block's bytes count the draft's share. The
price is that a block id holds draft K/V only where the draft wrote it for that sequence, so the draft trusts no
K/V it did not write itself: a sequence the worker first sees (a new request, a prefix-cache hit, a forked
sample) or sees again after a preemption starts with none, and the draft computes its tokens, prompt included,
when it first proposes for it. It computes nothing for a sequence that does not speculate.

Each proposal computes the tokens the draft lacks (usually the target's new token; two when all k drafts were
accepted; the whole sequence the first time), takes its greedy token, then runs k - 1 decode steps, each writing
the previous proposal's K/V into a lookahead slot the scheduler allocated with the step. Next time, the proposals
the target accepted keep their K/V and the rejected ones' slots are written again.

Proposals are target token ids: the draft's logits are cut to the target's vocabulary (their sizes may differ
where the embeddings are padded), so an id the target has no row for is never proposed. The other way round, a
sequence that holds an id the draft has no embedding row for (a target padded wider than its draft, as Qwen2.5-7B's
152064 rows are against Qwen2.5-0.5B's 151936, with the id in the prompt or sampled by the target) gets no proposals
from then on: it decodes plainly, and the draft never reads that id. Each sequence's ids are checked once, as they
arrive."""
from __future__ import annotations

import numpy as np
import torch

from qwenserve.model.layers.attention import AttentionMetadata, DecodeGroup, PagedKVCache, PrefillSpan


class DraftModelProposer:
    def __init__(self, model, kv_cache: PagedKVCache, target_vocab_size: int, draft_vocab_size: int,
                 max_model_len: int, decode_kernel: bool):
        """model: the draft (a CausalLM, one stage); kv_cache: its cache, with as many blocks as the target's;
        draft_vocab_size: the draft's embedding rows (ids from it up get no proposals); max_model_len: the draft's
        context length (no K/V is written past it); decode_kernel: decode attention runs on the CPU kernel (then
        decode groups carry context_lens)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.target_vocab_size = target_vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.max_model_len = max_model_len
        self.decode_kernel = decode_kernel
        self.device = model.device

    @torch.inference_mode()
    def propose_batch(self, requests: list[tuple]) -> list[list[int]]:
        """requests: (sequence state, its tokens including this step's, how many proposals) each; the state has
        block_table, draft_num_computed and draft_proposal (worker/input_batch.py's SequenceState). Returns the
        proposals of each, in order."""
        out: list[list[int]] = [[] for _ in requests]
        active = []  # (index, seq, tokens, proposals wanted)
        for i, (seq, tokens, num) in enumerate(requests):
            num = min(num, self.max_model_len - len(tokens) + 1)  # the last proposal's K/V is never written
            if num >= 1 and self._draft_reads(seq, tokens):
                active.append((i, seq, tokens, num))
        if not active:
            return out
        # the tokens each sequence's draft K/V lacks, its last one's logits giving the first proposal
        rows = []
        for _, seq, tokens, _ in active:
            start = min(_valid_prefix(seq, tokens), len(tokens) - 1)
            rows.append((seq.block_table, start, len(tokens)))
        first = self._forward(rows, [tokens for _, _, tokens, _ in active])
        for (i, _, _, _), token in zip(active, first):
            out[i].append(token)
        # then one decode step for each further proposal, the sequences that want one
        for step in range(1, max(num for *_, num in active)):
            members = [(i, seq, tokens) for i, seq, tokens, num in active if num > step]
            decode_rows = [(seq.block_table, len(tokens) + step - 1, len(tokens) + step) for _, seq, tokens in members]
            inputs = [[out[i][-1]] for i, _, _ in members]
            for (i, _, _), token in zip(members, self._forward(decode_rows, inputs, whole=False)):
                out[i].append(token)
        for i, seq, tokens, _ in active:
            seq.draft_num_computed = len(tokens)
            seq.draft_proposal = out[i][:-1]  # those whose K/V were written, after the tokens
        return out

    def _draft_reads(self, seq, tokens: list[int]) -> bool:
        """Whether the draft has an embedding row for every id of tokens. Only the ids not seen before are checked
        (a sequence's tokens only grow), and a sequence found with one stays out for good."""
        if not seq.draft_out_of_vocab and seq.draft_vocab_checked < len(tokens):
            seq.draft_out_of_vocab = max(tokens[seq.draft_vocab_checked:]) >= self.draft_vocab_size
            seq.draft_vocab_checked = len(tokens)
        return not seq.draft_out_of_vocab

    def _forward(self, rows: list[tuple[list[int], int, int]], token_lists: list[list[int]],
                 whole: bool = True) -> list[int]:
        """One draft forward: for each row (block table, start, end) the tokens at positions start..end-1, taken
        from token_lists (the sequence's tokens when whole, else just the new ones); returns each row's greedy next
        token within the target's vocabulary."""
        bs = self.block_size
        ids, positions, slots, last = [], [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        flat = 0
        for (block_table, start, end), tokens in zip(rows, token_lists):
            n = end - start
            ids.extend(tokens[start:end] if whole else tokens)
            pos = np.arange(start, end)
            table = np.asarray(block_table[:-(-end // bs)], dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if n == 1 and start > 0:
                decode_rows.append(flat)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(PrefillSpan(flat, flat + n, None if start == 0 else self._tensor(table), end))
            flat += n
            last.append(flat - 1)
        decode = [self._decode_group(decode_rows, decode_tables, decode_lens, flat)] if decode_rows else []
        metadata = AttentionMetadata(self.kv_cache, self._tensor(np.concatenate(slots)), decode, prefills)
        hidden = self.model(self._tensor(ids), self._tensor(np.concatenate(positions)), metadata)
        logits = self.model.compute_logits(hidden[self._tensor(last)])
        return logits[:, :self.target_vocab_size].argmax(dim=-1).tolist()

    def _decode_group(self, rows: list[int], tables: list[np.ndarray], lens: list[int], num_rows: int) -> DecodeGroup:
        """The decode rows as one batched attention (each sequence read at its own length)."""
        longest = max(lens)
        block_tables = np.zeros((len(rows), -(-longest // self.block_size)), dtype=np.int64)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = table
        lens_arr = np.asarray(lens)
        mask = context_lens = None
        if self.decode_kernel:
            context_lens = self._tensor(lens_arr)
        elif (lens_arr != longest).any():
            mask = self._tensor(np.arange(longest)[None, :] < lens_arr[:, None], torch.bool)[:, None, None, :]
        index = None if len(rows) == num_rows else self._tensor(rows)
        return DecodeGroup(index, self._tensor(block_tables), longest, mask, context_lens, tuple(lens))

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.as_tensor(data, dtype=dtype).to(self.device)


def _valid_prefix(seq, tokens: list[int]) -> int:
    """How many of tokens' positions hold the draft's K/V of exactly those tokens: what it computed, and after
    that the proposals it wrote as far as the tokens agree with them (the accepted ones)."""
    valid = seq.draft_num_computed
    for proposed in seq.draft_proposal:
        if valid >= len(tokens) or tokens[valid] != proposed:
            break
        valid += 1
    return valid
