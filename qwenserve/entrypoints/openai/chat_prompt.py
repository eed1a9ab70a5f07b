"""A conversation as the prompt the engine runs, for /v1/chat/completions and /tokenize alike: its media parts
replaced by their placeholders (chat_content.py), fetched, decoded and preprocessed in a thread, and the messages
rendered by the chat template. Every refusal is a 400 whose param is the content part at fault
(messages[0].content[1])."""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from qwenserve.config.errors import RequestError
from qwenserve.entrypoints.chat_content import MediaPart, load_media, media_placeholders, split_content
from qwenserve.entrypoints.media import MediaConnector
from qwenserve.entrypoints.openai.protocol import check_template_ending
from qwenserve.entrypoints.openai.serving_engine import APIError, chat_text


@dataclass(frozen=True)
class ChatPrompt:
    prompt: dict  # what the engine takes: prompt_token_ids (one pad token per image or video), multi_modal_data
    parts: list[MediaPart]  # the media parts in prompt order, each named as the request names it
    text: str = ""  # the rendered conversation (the reasoning parser reads whether it opened a think block)


class ChatPromptRenderer:
    def __init__(self, engine):
        """engine: an AsyncLLMEngine (its tokenizer, vision config, media settings and image processor)."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.placeholders = media_placeholders(engine.tokenizer, engine.vision)
        self.media = MediaConnector.from_config(engine.multimodal)

    async def render(self, messages: list, add_generation_prompt: bool, tools: list[dict] | None = None,
                     template_kwargs: dict | None = None, continue_final_message: bool = False) -> ChatPrompt:
        """messages: ChatMessages. Their media are fetched and preprocessed in a thread (a remote URL takes up to
        --media-fetch-timeout, a video's resize a while; the event loop and the engine's thread serve others
        meanwhile). continue_final_message: the final message is left open for the answer to continue."""
        try:
            check_template_ending(add_generation_prompt, continue_final_message)
            split, parts = split_content([{"content": m.content} for m in messages], self.placeholders,
                                         self.engine.multimodal.limit_mm_per_prompt)
            messages = [m.model_copy(update={"content": s["content"]}) for m, s in zip(messages, split)]
            media = await asyncio.to_thread(self._load_and_preprocess, parts) if parts else {}
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from e
        text = chat_text(self.tokenizer, messages, add_generation_prompt, tools, template_kwargs,
                         continue_final_message)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ChatPrompt({"prompt_token_ids": ids} | ({"multi_modal_data": media} if media else {}), parts, text)

    def engine_ids(self, chat: ChatPrompt) -> list[int]:
        """The token ids the engine runs for the prompt: each image's and video's pad token repeated to its size
        in tokens, by the engine's own expansion."""
        try:
            return self.engine.prompt_token_ids(chat.prompt)
        except RequestError as e:
            raise name_the_part(APIError(400, str(e), param=e.param), chat.parts) from e

    def _load_and_preprocess(self, parts: list[MediaPart]) -> dict[str, list]:
        """multi_modal_data of ProcessedImages, which the engine takes as they are; a refusal names the part."""
        media = load_media(parts, self.media)
        processor = self.engine.image_processor
        steps = {"image": processor.process, "video": processor.process_video}
        out = {}
        for kind, items in media.items():
            out[kind] = []
            for item, where in zip(items, [p.where for p in parts if p.modality == kind]):
                try:
                    out[kind].append(steps[kind](item))
                except RequestError as e:
                    raise RequestError(f"{where}: {e}", param=where) from None
        return out


def name_the_part(e: APIError, parts: list[MediaPart]) -> APIError:
    """The engine names a refused image or video by its place in multi_modal_data (multi_modal_data.image[1]);
    the client knows it as a content part (messages[0].content[3])."""
    found = re.fullmatch(r"multi_modal_data\.(image|video)\[(\d+)\]", e.param or "")
    if not found:
        return e
    kind, index = found.group(1), int(found.group(2))
    where = [p.where for p in parts if p.modality == kind][index]
    message = re.sub(rf"^{kind} {index + 1}: ", "", e.message)
    return APIError(e.status, f"{where}: {message}", e.type, param=where, code=e.code)
