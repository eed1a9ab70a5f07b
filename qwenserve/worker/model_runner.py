"""Runs one scheduled step: the flat batch through the model, logits only for the rows that need them (the
last position of each sequence that takes a token, plus the prompt positions of a request that asked for
prompt logprobs), then sampling. What leaves is a ModelRunnerOutput: token ids and requested logprobs.

With images (a multimodal model): the step's tokens are embedded here, the vision tower's rows for the image
placeholders in the batch (from the encoder cache, or the tower run once for every image the cache lacks) are
written over theirs, and the model takes the rows as inputs_embeds.

With speculative decoding a sequence's last k + 1 positions sample: the drafts are verified
(sample/rejection_sampler.py), and new drafts proposed where the scheduler asked for them; drafts also leave in the
ModelRunnerOutput."""
from __future__ import annotations

import numpy as np
import torch

from qwenserve.core.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from qwenserve.lora.manager import LoRAManager
from qwenserve.model.interface import CausalLM, is_multimodal
from qwenserve.model.layers.attention import AttentionMetadata, PagedKVCache, PrefillSpan, decode_kernel_available
from qwenserve.sample.logprobs import top_logprobs
from qwenserve.sample.rejection_sampler import RejectionSampler, VerifiedTokens
from qwenserve.sample.sampler import Sampler
from qwenserve.spec_decode.draft_model import DraftModelProposer
from qwenserve.spec_decode.ngram_proposer import NgramProposer
from qwenserve.worker.encoder_cache import EncoderCache
from qwenserve.worker.input_batch import ImageRows, InputBatch, ModelInputs, PromptChunk

DEFAULT_ENCODER_CACHE_BYTES = 256 << 20


@torch.inference_mode()
def full_logits(model: CausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence ([T, vocab], float32) from a single prefill, with a cache of
    its own: for scoring, validation and tests."""
    device = model.device
    spec = model.kv_cache_spec()
    n, block = len(token_ids), 16
    cache = PagedKVCache(spec.num_layers, -(-n // block), block, spec.num_kv_heads, spec.head_dim, spec.dtype,
                         device)
    positions = torch.arange(n, device=device)
    metadata = AttentionMetadata(cache, positions, [], [PrefillSpan(0, n, None, n, prompt_len=n)])
    hidden = model(torch.tensor(token_ids, device=device), positions, metadata)
    return model.compute_logits(hidden).float()


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, device: torch.device | str = "cpu",
                 record_logits: bool = False, lora_manager: LoRAManager | None = None,
                 encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES,
                 proposer: NgramProposer | DraftModelProposer | None = None):
        """lora_manager: the model's adapters (its projections already wrapped), with enable_lora. proposer: drafts
        for speculative decoding; None: off."""
        self.model = model
        self.lora_manager = lora_manager
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.multimodal = is_multimodal(model)
        self.encoder_cache = EncoderCache(encoder_cache_bytes) if self.multimodal else None
        self.input_batch = InputBatch(kv_cache.block_size, self.device, decode_kernel_available(self.device),
                                      model.spatial_merge_size if self.multimodal else None)
        # sampling runs on the host: per-request generators and small per-row ops (logits are copied there)
        self.sampler = Sampler("cpu")
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.proposer = proposer
        self.record_logits = record_logits

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Sampled tokens on the last pipeline stage; None on the others, which pass their activations on."""
        self.input_batch.update(scheduler_output)
        inputs = self.input_batch.prepare(scheduler_output, self.kv_cache)
        failed_loras = {}
        if inputs.lora_spans:
            if self.lora_manager is None:
                raise RuntimeError("a sequence with a LoRA adapter reached a worker started without enable_lora")
            inputs.attn_metadata.lora, failed_loras = self.lora_manager.batch(inputs.lora_spans,
                                                                              len(inputs.input_ids))
        pp = self.model.pp
        intermediate = None
        if not pp.is_first:
            intermediate = pp.recv(len(inputs.input_ids), self.model.hidden_size, self.model.dtype, self.device)
        if inputs.image_rows and pp.is_first:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata, intermediate,
                                inputs_embeds=self._embeds_with_images(inputs.input_ids, inputs.image_rows))
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata, intermediate)
        if not pp.is_last:
            pp.send(*hidden)
            return None
        out = ModelRunnerOutput(failed_loras=failed_loras)
        if inputs.sampling_seqs:
            # the sequences' token lists grow when the scheduler sends these tokens back (step.py)
            logits = self.model.compute_logits(hidden[inputs.sample_rows]).cpu()
            taken = self._sample(logits, inputs, scheduler_output.grammar_bitmask)
            if self.record_logits:
                out.logits = []
            to_propose = []  # (sequence, its tokens with this step's, how many drafts)
            for seq, tokens, logprobs, rows in zip(inputs.sampling_seqs, taken.token_ids, taken.logprobs, taken.rows):
                out.seq_ids += [seq.seq_id] * len(tokens)
                out.sampled_token_ids += tokens
                out.logprobs += logprobs
                if self.record_logits:
                    out.logits += [logits[row].float() for row in rows]
                num_drafts = scheduler_output.num_draft_tokens_to_propose.get(seq.seq_id)
                if num_drafts and self.proposer is not None:
                    to_propose.append((seq, seq.token_ids + tokens, num_drafts))
            if to_propose:  # one call for the batch: a draft model runs it as one batch
                for (seq, _, _), drafts in zip(to_propose, self.proposer.propose_batch(to_propose)):
                    if drafts:
                        out.draft_token_ids[seq.seq_id] = drafts
        for chunk in inputs.prompt_chunks:
            out.prompt_logprobs[chunk.seq.seq_id] = (chunk.first_position + 1, self._prompt_logprobs(hidden, chunk))
        return out

    def _embeds_with_images(self, input_ids: torch.Tensor, image_rows: list[ImageRows]) -> torch.Tensor:
        """The step's input rows: token embeddings, with each image's rows written over its placeholders'."""
        embeds = self.model.embed_tokens(input_ids)
        outputs = self._image_outputs([part.image for part in image_rows])
        for part in image_rows:
            rows = outputs[part.image.content_hash][part.first:part.last]
            embeds[part.row:part.row + len(rows)] = rows.to(embeds.dtype)
        return embeds

    def _image_outputs(self, images: list) -> dict[bytes, torch.Tensor]:
        """The tower's output of each image, by content hash: from the cache, the missing ones in one tower run."""
        cache = self.encoder_cache
        found, missing = {}, {}
        for image in images:
            out = cache.get(image.content_hash)
            if out is not None:
                found[image.content_hash] = out
            else:
                missing[image.content_hash] = image
        if missing:
            todo = list(missing.values())
            pixels = torch.from_numpy(np.concatenate([image.pixel_values for image in todo])).to(self.device)
            merged = self.model.embed_images(pixels, [image.grid for image in todo])
            for image, out in zip(todo, merged.split([image.num_tokens for image in todo])):
                found[image.content_hash] = out
                cache.put(image.content_hash, out)
        return found

    def _sample(self, logits: torch.Tensor, inputs: ModelInputs, grammar: GrammarBitmask | None) -> VerifiedTokens:
        """The tokens each sampling sequence takes: one, or with drafts to verify, the accepted ones and one more."""
        seqs, drafts = inputs.sampling_seqs, inputs.draft_token_ids
        if not any(drafts):  # every step without speculation: one row per sequence, no draft bookkeeping
            rows = None if grammar is None else {seq.seq_id: i for i, seq in enumerate(seqs)}
            sampled = self.sampler(logits, seqs, _grammar_rows(grammar, rows))
            return VerifiedTokens([[t] for t in sampled.token_ids], [[lp] for lp in sampled.logprobs],
                                  [[i] for i in range(len(seqs))])
        first_rows, row = {}, 0
        for seq, draft in zip(seqs, drafts):
            first_rows[seq.seq_id] = row
            row += len(draft) + 1
        constrained = set(grammar.seq_ids) if grammar is not None else set()
        if any(draft for seq, draft in zip(seqs, drafts) if seq.seq_id in constrained):
            raise RuntimeError("a constrained sequence brought drafts: its grammar masks one token a step")
        return self.rejection_sampler(logits, seqs, drafts, _grammar_rows(grammar, first_rows))

    def _prompt_logprobs(self, hidden: torch.Tensor, chunk: PromptChunk) -> list:
        """Entries for the prompt tokens this chunk predicts: row i predicts the token at first_position + i + 1
        (the chunk's last row may predict the first output token, which is not a prompt logprob)."""
        seq = chunk.seq
        targets = seq.token_ids[chunk.first_position + 1:min(chunk.first_position + 1 + chunk.num_rows,
                                                             seq.num_prompt_tokens)]
        if not targets:
            return []
        rows = hidden[chunk.first_row:chunk.first_row + len(targets)]
        logprobs = torch.log_softmax(self.model.compute_logits(rows).float().cpu(), dim=-1)
        return top_logprobs(logprobs, torch.tensor(targets), seq.params.prompt_logprobs)


def _grammar_rows(grammar: GrammarBitmask | None,
                  row_of: dict[int, int] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's grammar bitmask as the sampler takes it: (the rows of the constrained sequences, their masks).
    row_of: each sampling sequence's (first) logits row."""
    if grammar is None:
        return None
    missing = [seq_id for seq_id in grammar.seq_ids if seq_id not in row_of]
    if missing:  # the engine and this worker disagree on who samples: sampling unmasked would break the grammar
        raise RuntimeError(f"grammar bitmask rows for sequences {missing} that take no token this step")
    return torch.tensor([row_of[seq_id] for seq_id in grammar.seq_ids]), torch.from_numpy(grammar.bitmask)
