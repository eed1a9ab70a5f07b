"""The worker's adapters: which are loaded (up to max_cpu_loras, least recently used evicted), which sit in the
batch's max_loras slots, and the LoRABatch of each step.

At start every projection an adapter may target is wrapped (layers.LoRALinear), whatever adapters come later, so
loading one never changes the model's modules. Loading reads the PEFT files, checks them against the base model
(peft.py) and slices them for this rank; putting a loaded adapter in a slot only points each wrapper at its
weights. An adapter that cannot be loaded (its files changed since the engine checked them) fails the requests
that use it, not the step: the engine ends them, the others run on."""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import torch.distributed as dist

from qwenserve.config.engine_config import LoRAConfig
from qwenserve.config.model_config import ModelConfig
from qwenserve.lora.batch import LoRABatch
from qwenserve.lora.layers import LoRALinear
from qwenserve.lora.ops import LayerAdapter
from qwenserve.lora.peft import TARGET_MODULES, LoRAAdapterError, expert_layer_error, load_adapter
from qwenserve.lora.request import LoRARequest
from qwenserve.model.interface import CausalLM

logger = logging.getLogger(__name__)
STACKED_MAX_ROWS = 64  # steps of up to this many rows run their adapters stacked (ops.py)


class LoRAManager:
    def __init__(self, model: CausalLM, model_config: ModelConfig, config: LoRAConfig):
        self.model_config = model_config
        self.config = config
        self.device = model.device
        # the adapters' weights and products: float32 on the CPU (ops.py says why), else the run dtype
        self.dtype = torch.float32 if self.device.type == "cpu" else model.dtype
        # (layer, checkpoint module e.g. "q_proj") -> (the wrapper of its (fused) layer, its shard id there)
        self.targets: dict[tuple[int, str], tuple[LoRALinear, str | int | None]] = {}
        self.wrappers: list[LoRALinear] = []
        # (layer, checkpoint module) with no projection to adapt: a mixture-of-experts layer's MLP
        self.unadaptable: set[tuple[int, str]] = set()
        self._wrap(model)
        # lora_int_id -> the adapter's weights per wrapper, least recently used first
        self.loaded: OrderedDict[int, dict[LoRALinear, LayerAdapter]] = OrderedDict()
        self.slot_ids: list[int | None] = [None] * config.max_loras  # lora_int_id in each slot
        self._slot_use: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first

    def _wrap(self, model: CausalLM) -> None:
        packed = model.packed_modules_mapping
        wrapped: dict[str, LoRALinear] = {}
        for layer in range(self.model_config.num_hidden_layers):
            for module, block in TARGET_MODULES.items():
                if model.checkpoint_target(f"model.layers.{layer}.{block}.{module}.weight") is None:
                    continue  # another pipeline stage's layer
                fused, shard_id = packed.get(module, (module, None))
                path = f"model.layers.{layer}.{block}.{fused}"
                if path not in wrapped:
                    parent_path, _, child = path.rpartition(".")
                    parent = model.get_submodule(parent_path)
                    if not hasattr(parent, child):  # experts and a router where a dense MLP would be
                        self.unadaptable.add((layer, module))
                        continue
                    wrapped[path] = LoRALinear(getattr(parent, child), self.config.max_loras)
                    setattr(parent, child, wrapped[path])
                self.targets[(layer, module)] = (wrapped[path], shard_id)
        self.wrappers = list(wrapped.values())

    # ---- loaded adapters ------------------------------------------------------------------------------

    @property
    def loaded_ids(self) -> list[int]:
        """The adapters in memory, least recently used first."""
        return list(self.loaded)

    def _read(self, request: LoRARequest) -> dict[LoRALinear, LayerAdapter]:
        """The adapter's weights, read from its files, checked and sliced for this rank's wrappers."""
        adapter = load_adapter(request.lora_path, self.model_config, self.config.max_lora_rank)
        parts: dict[LoRALinear, dict] = {}
        for key, weights in adapter.weights.items():
            if key in self.unadaptable:  # load_adapter refuses these already, by the model class's expert_layers
                raise expert_layer_error(request.lora_path, *key)
            if key not in self.targets:
                continue  # a layer of another pipeline stage
            wrapper, shard_id = self.targets[key]
            parts.setdefault(wrapper, {})[shard_id] = weights
        prepared = {w: w.prepare(p, adapter.config.scaling, self.dtype, self.device) for w, p in parts.items()}
        logger.info("loaded LoRA adapter %r (id %d, r=%d) from %s", request.lora_name, request.lora_int_id,
                    adapter.config.rank, request.lora_path)
        return prepared

    def _load_missing(self, requests: list[LoRARequest], keep: set[int]) -> dict[int, str]:
        """Load the step's adapters not in memory (evicting the least recently used ones not in keep, the step's
        adapters); returns the error of each that could not be loaded, which stays out of memory.

        Every rank of the engine decides the same loads (they see the same steps), so where there are several
        ranks they agree on the failures: an adapter that failed on any rank fails on all, and no rank runs a
        request with part of an adapter."""
        missing = [r for r in requests if r.lora_int_id not in self.loaded]
        if not missing:
            return {}
        read, failed = {}, {}
        for request in missing:
            try:
                read[request.lora_int_id] = self._read(request)
            except Exception as e:  # noqa: BLE001 (files changed since the engine's check, memory: its requests fail)
                logger.error("LoRA adapter %r (id %d) could not be loaded: %s", request.lora_name,
                             request.lora_int_id, e)
                failed[request.lora_int_id] = str(e) if isinstance(e, LoRAAdapterError) else f"{type(e).__name__}: {e}"
        if dist.is_initialized() and dist.get_world_size() > 1:
            flags = torch.tensor([r.lora_int_id in failed for r in missing], dtype=torch.int32, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            for request, flag in zip(missing, flags.tolist()):
                if flag and request.lora_int_id not in failed:
                    failed[request.lora_int_id] = "it could not be loaded on another worker rank (its log says why)"
        for lora_int_id, prepared in read.items():
            if lora_int_id in failed:
                continue
            while len(self.loaded) >= self.config.max_cpu_loras:
                victim = next(i for i in self.loaded if i not in keep)  # exists: a step has at most max_loras < this
                self._evict(victim)
            self.loaded[lora_int_id] = prepared
        return failed

    def _evict(self, lora_int_id: int) -> None:
        del self.loaded[lora_int_id]
        if lora_int_id in self.slot_ids:
            self._fill_slot(self.slot_ids.index(lora_int_id), None, {})

    def _fill_slot(self, slot: int, lora_int_id: int | None, weights: dict[LoRALinear, LayerAdapter]) -> None:
        self.slot_ids[slot] = lora_int_id
        for wrapper in self.wrappers:
            wrapper.set_slot(slot, weights.get(wrapper))

    # ---- the step ---------------------------------------------------------------------------------------

    def _slot_for(self, lora_id: int, keep: set[int]) -> int:
        """The slot holding the (loaded) adapter, put there now if needed (a free slot, else the least recently
        used one whose adapter is not in the step)."""
        self.loaded.move_to_end(lora_id)
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            free = [s for s, held in enumerate(self.slot_ids) if held is None]
            slot = free[0] if free else next(s for s in self._slot_use if self.slot_ids[s] not in keep)
            self._fill_slot(slot, lora_id, self.loaded[lora_id])
        self._slot_use.pop(slot, None)
        self._slot_use[slot] = None
        return slot

    def batch(self, spans: list[tuple[int, int, LoRARequest]],
              num_rows: int) -> tuple[LoRABatch | None, dict[int, str]]:
        """The step's LoRABatch from (first row, end row, adapter) of each sequence that runs with one, in a step of
        num_rows rows (None when none does), and the error of each adapter that could not be loaded: its
        sequences' rows run with no adapter, and the engine fails their requests."""
        if not spans:
            return None, {}
        requests = {r.lora_int_id: r for _, _, r in spans}
        if len(requests) > self.config.max_loras:  # the scheduler keeps to max_loras: this is a bug, not a request
            raise RuntimeError(f"a step with {len(requests)} adapters, above max_loras {self.config.max_loras}")
        keep = set(requests)
        failed = self._load_missing(list(requests.values()), keep)
        slot_of = {lora_id: self._slot_for(lora_id, keep) for lora_id in requests if lora_id not in failed}
        if not slot_of:
            return None, failed
        # stacked when the step is small (a decode step: padding each slot to the busiest one's rows costs
        # little) and uses every filled slot (the stacked weights hold them all: running some would read the rest
        # for nothing)
        filled = tuple(slot for slot, lora_id in enumerate(self.slot_ids) if lora_id is not None)
        stack = filled if num_rows <= STACKED_MAX_ROWS and len(slot_of) == len(filled) > 1 else ()
        batch = LoRABatch.from_spans([(s, e, slot_of[r.lora_int_id]) for s, e, r in spans
                                      if r.lora_int_id in slot_of], self.device, stack)
        return batch, failed
