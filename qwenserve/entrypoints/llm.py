"""The offline Python API, as in vLLM: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools
import time

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.data_parallel import build_engine
from qwenserve.engine.outputs import RequestOutput
from qwenserve.entrypoints.chat_content import load_media, media_placeholders, split_content
from qwenserve.entrypoints.media import MediaConnector
from qwenserve.entrypoints.openai.protocol import check_template_ending, check_template_kwargs
from qwenserve.lora.request import LoRARequest
from qwenserve.model.loader.tokenizer import chat_prompt_ids
from qwenserve.sample.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", config: EngineConfig | None = None,
                 **engine_args):
        """Engine arguments by name (block_size=32, kv_cache_memory="1GiB", ...; see config/engine_config.py;
        one not given takes its environment variable's value where it has one, e.g. QWENSERVE_CPU_KERNELS), or a
        whole EngineConfig, used as it is."""
        self.engine = build_engine(config or EngineConfig.from_user_settings(model=model, dtype=dtype, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """prompts: a string, a {"prompt": ...} or {"prompt_token_ids": [...]} dict (with "multi_modal_data":
        {"image": <PIL image or list of them>} for a vision-language model), or a list of them. One output per
        prompt, in order. lora_request: the LoRA adapter every prompt runs with, or one per prompt (None: the base
        model); needs enable_lora."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        adapters = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} lora_requests for {len(prompts)} prompts")
        return self._run(list(zip(prompts, params, adapters)), use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations. A
        message's content may be a list of OpenAI parts (entrypoints/chat_content.py): text, and for a
        vision-language model images ({"type": "image_url", "image_url": {"url": ...}} with a data:, http(s):// or
        file:// URL, fetched and read as allowed_media_domains and allowed_local_media_path allow, or
        {"type": "image_pil", "image_pil": <PIL image>}). As in vLLM: continue_final_message leaves the final
        message open for the answer to continue (add_generation_prompt must then be False); chat_template_kwargs
        are more variables for the chat template (Qwen3's enable_thinking); tools (OpenAI function definitions)
        are shown to the template, and the answer is returned as text."""
        check_template_ending(add_generation_prompt, continue_final_message)
        chat_template_kwargs = check_template_kwargs(chat_template_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        mm = self.engine.config.multimodal
        placeholders = media_placeholders(tok, self.engine.resolved_model.config.vision)
        connector = MediaConnector.from_config(mm)
        prompts = []
        for conv in conversations:
            conv, parts = split_content(conv, placeholders, mm.limit_mm_per_prompt)
            prompt = {"prompt_token_ids": chat_prompt_ids(tok, conv, add_generation_prompt, tools,
                                                          chat_template_kwargs, continue_final_message)}
            if parts:
                prompt["multi_modal_data"] = load_media(parts, connector)
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, work: list, use_tqdm: bool) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, params, adapter in work:
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, params, lora_request=adapter)
        except Exception:
            for rid in ids:  # a bad prompt aborts the whole call, leaving nothing behind in the engine
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"output {generated / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
