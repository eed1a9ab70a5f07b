"""The worker's copy of every sequence it runs (`SequenceState`: tokens, block table, sampling state, images), kept
across steps from the scheduler's deltas, and the flat batch built from them each step: token ids,
positions, cache slots and attention metadata, with no padding to the longest prompt.

For a model with multimodal rotary (Qwen2-VL) positions are [3, T]: a prompt's come from its images' grids
(computed once per sequence), later tokens' are their index plus the prompt's delta on all three axes. The batch
then also says which rows are which image's placeholders (`ImageRows`), for the runner to splice the vision tower's
output in."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from qwenserve.core.multimodal import ImageInput
from qwenserve.core.step import SchedulerOutput
from qwenserve.lora.request import LoRARequest
from qwenserve.model.layers.attention import AttentionMetadata, DecodeGroup, PagedKVCache, PrefillSpan
from qwenserve.model.layers.rotary import mrope_positions
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
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    images: tuple[ImageInput, ...] = ()
    prompt_mrope: np.ndarray | None = None  # [3, prompt tokens] M-RoPE positions, when the model uses them
    mrope_delta: int = 0  # what a token past the prompt adds to its index
    # speculative decoding with a draft model (spec_decode/draft_model.py): positions 0.. of this many hold the
    # draft's K/V of its tokens, and the proposals whose K/V the draft wrote after them
    draft_num_computed: int = 0
    draft_proposal: list[int] = field(default_factory=list)
    # how many of its tokens were checked for ids the draft has no embedding row for, and whether one was found
    # (then it gets no proposals)
    draft_vocab_checked: int = 0
    draft_out_of_vocab: bool = False

    def mrope(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] M-RoPE positions of tokens start..end-1."""
        n = self.num_prompt_tokens
        later = np.arange(max(start, n), max(end, n)) + self.mrope_delta
        return np.concatenate([self.prompt_mrope[:, start:min(end, n)], np.broadcast_to(later, (3, len(later)))],
                              axis=1)

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
class ImageRows:
    """Rows [row, row + last - first) of the flat batch are placeholders first..last-1 of image."""
    row: int
    image: ImageInput
    first: int
    last: int


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]; [3, T] for M-RoPE
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # rows whose logits pick each sampling sequence's next token(s)
    sampling_seqs: list[SequenceState]  # sequences that reached their last known token: they take a new one
    prompt_chunks: list[PromptChunk] = field(default_factory=list)
    # (first row, end row, adapter) of each sequence that runs with an adapter, for the step's LoRABatch
    lora_spans: list[tuple[int, int, LoRARequest]] = field(default_factory=list)
    image_rows: list[ImageRows] = field(default_factory=list)
    # per sampling sequence, the drafts it verifies (speculative decoding): its sample rows are its last
    # len(drafts) + 1, one after its last known token and one after each draft
    draft_token_ids: list[list[int]] = field(default_factory=list)


class InputBatch:
    def __init__(self, block_size: int, device: torch.device, decode_kernel: bool, mrope_merge: int | None = None):
        """mrope_merge: the vision tower's spatial merge size when the model takes M-RoPE positions, else None."""
        self.mrope_merge = mrope_merge
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
            seq = SequenceState(seq_id=new.seq_id, token_ids=list(new.token_ids),
                                num_prompt_tokens=new.num_prompt_tokens, params=p, block_table=list(new.block_ids),
                                num_computed_tokens=new.num_computed_tokens, generator=generator,
                                lora_request=new.lora_request, images=new.images)
            if self.mrope_merge is not None:
                images = [(image.offset, image.grid, image.time_interval) for image in seq.images]
                seq.prompt_mrope, seq.mrope_delta = mrope_positions(seq.num_prompt_tokens, images, self.mrope_merge)
            self.seqs[new.seq_id] = seq
        for cached in scheduler_output.cached_seqs:
            seq = self.seqs[cached.seq_id]
            seq.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                seq.block_table = list(cached.new_block_ids)
                seq.draft_num_computed, seq.draft_proposal = 0, []  # the draft's K/V went with the blocks
            else:
                seq.block_table.extend(cached.new_block_ids)
            seq.num_computed_tokens = cached.num_computed_tokens

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.as_tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, scheduler_output: SchedulerOutput, kv_cache: PagedKVCache) -> ModelInputs:
        bs = self.block_size
        ids, positions, slots = [], [], []
        decode_rows, decode_tables, decode_lens, decode_prompts, prefills = [], [], [], [], []
        sample_rows, sampling_seqs, prompt_chunks, lora_spans, image_rows, drafts_of = [], [], [], [], [], []
        row = 0
        for seq_id, n in scheduler_output.num_scheduled_tokens.items():
            seq = self.seqs[seq_id]
            drafts = scheduler_output.spec_token_ids.get(seq_id, [])
            tokens = seq.token_ids + drafts if drafts else seq.token_ids
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(tokens[start:end])
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table[:-(-end // bs)], dtype=np.int64)
            positions.append(pos if self.mrope_merge is None else seq.mrope(start, end))
            for image in seq.images:
                if image.overlaps(start, end):  # a chunk may hold only part of an image
                    first, last = max(start, image.offset), min(end, image.end)
                    image_rows.append(ImageRows(row + first - start, image, first - image.offset,
                                                last - image.offset))
            slots.append(table[pos // bs] * bs + pos % bs)
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
                decode_prompts.append(seq.num_prompt_tokens)
            else:
                prefills.append(PrefillSpan(row, row + n, None if start == 0 else self._tensor(table), end,
                                            seq.num_prompt_tokens))
            if end == len(tokens):
                sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
                sampling_seqs.append(seq)
                drafts_of.append(drafts)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                prompt_chunks.append(PromptChunk(seq, row, start, min(end, seq.num_prompt_tokens) - start))
            if seq.lora_request is not None:
                lora_spans.append((row, row + n, seq.lora_request))
            row += n

        decode = self._decode_groups(decode_rows, decode_tables, decode_lens, decode_prompts, row)
        metadata = AttentionMetadata(kv_cache, self._tensor(np.concatenate(slots)), decode, prefills)
        return ModelInputs(input_ids=self._tensor(ids), positions=self._tensor(np.concatenate(positions, axis=-1)),
                           attn_metadata=metadata, sample_rows=self._tensor(sample_rows), sampling_seqs=sampling_seqs,
                           prompt_chunks=prompt_chunks, lora_spans=lora_spans, image_rows=image_rows,
                           draft_token_ids=drafts_of)

    def _decode_groups(self, rows: list[int], tables: list[np.ndarray], lens: list[int], prompt_lens: list[int],
                       num_rows: int):
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
            out.append(DecodeGroup(index, self._tensor(block_tables), longest, mask, context_lens,
                                   tuple(member_lens.tolist()), tuple(np.asarray(prompt_lens)[members].tolist())))
        return out
