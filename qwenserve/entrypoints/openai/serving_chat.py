"""/v1/chat/completions: a conversation rendered with the chat template, answered whole or streamed; with a
reasoning parser, the answer's reasoning comes out as `reasoning_content` (reasoning.py) and a constraint
(structured output, a forced tool call) applies only after it; with tools, the tool calls in the rest as OpenAI
`tool_calls` (tool_calls.py)."""
from __future__ import annotations

import dataclasses
import time

from fastapi import Request

from qwenserve.engine.outputs import RequestOutput
from qwenserve.entrypoints.openai.chat_prompt import ChatPromptRenderer, name_the_part
from qwenserve.entrypoints.openai.protocol import ChatCompletionRequest
from qwenserve.entrypoints.openai.reasoning import ReasoningSplitter, constraint_prefix
from qwenserve.entrypoints.openai.serving_engine import APIError, OpenAIServing, engine_ids_prefix, request_id, usage
from qwenserve.entrypoints.openai.tool_calls import ToolCallParser, parse_tool_calls, tag_token_ids

# the constraint kinds whose answer may start with blank tokens after the reasoning (JSON's own whitespace)
ANSWER_BLANKS = ("json", "json_object")


class OpenAIServingChat(OpenAIServing):
    PROMPT_PARAM = "messages"  # the prompt is made of the messages

    def __init__(self, *args, renderer: ChatPromptRenderer, reasoning_parser: str | None = None, **kwargs):
        """renderer: the conversations' prompts, shared with /tokenize; reasoning_parser: a name in
        reasoning.REASONING_PARSERS, or None to return answers whole as content."""
        super().__init__(*args, **kwargs)
        self.tool_tag_ids = tag_token_ids(self.tokenizer)
        self.renderer = renderer
        self.reasoning_parser = reasoning_parser

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        model, lora_request = self.models.resolve(body.model)
        params = self._params(body, tool_tag_ids=self.tool_tag_ids)
        tools = body.tools_in_use
        tool_names = {tool["function"]["name"] for tool in tools or ()}
        named, forced = body.named_tool, body.forces_tool_calls
        chat = await self.renderer.render(body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs,
                                          body.continue_final_message)
        if self.reasoning_parser and params.structured_outputs is not None:  # constrained after the reasoning
            prefix = constraint_prefix(self.reasoning_parser, chat.text)
            if prefix is not None and (forced or params.structured_outputs.kind in ANSWER_BLANKS):
                prefix = dataclasses.replace(prefix, answer_blanks=True)  # Qwen3's blank line after </think>
            params.structured_outputs = dataclasses.replace(params.structured_outputs, free_prefix=prefix)
        rid = f"chatcmpl-{request_id(request)}"
        created = int(time.time())
        try:
            admitted = await self._admit([chat.prompt], params, engine_ids_prefix(request, rid), body,
                                         lora_request)
        except APIError as e:
            raise name_the_part(e, chat.parts) from e
        top_k = params.logprobs or 0
        if body.stream:
            first = [{"index": i, "delta": {"role": "assistant", "content": body.echoed}, "logprobs": None,
                      "finish_reason": None} for i in range(params.n)]
            header = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
            return self._stream(request, header, admitted, body,
                                self._delta_choices(params.n, top_k, tool_names, body.parallel_tool_calls,
                                                    chat.text, forced, named), first)
        out = (await self._run(admitted, request))[0]
        choices = []
        for c in out.outputs:
            reasoning, text = (ReasoningSplitter(self.reasoning_parser, chat.text).split_whole(c.text)
                               if self.reasoning_parser else (None, c.text))
            message, finish_reason = {"role": "assistant", "content": text}, c.finish_reason
            if tools:
                content, calls = parse_tool_calls(text, tool_names, forced, named)
                calls = calls if body.parallel_tool_calls else calls[:1]
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [call.to_openai() for call in calls]}
                    finish_reason = _calls_finish_reason(finish_reason)
                elif forced:  # cut before a call was certain: its markup is no text either
                    message = {"role": "assistant", "content": content}
            if reasoning is not None:  # as vLLM: an answer that is all reasoning has no content
                # empty reasoning is none, as the stream (which sends no empty delta) gives it
                message = {**message, "reasoning_content": reasoning or None, "content": message["content"] or None}
            if body.echoed:
                message = {**message, "content": body.echoed + (message["content"] or "")}
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c, top_k),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": usage([out])}

    def _delta_choices(self, n: int, top_k: int, tool_names: set[str], parallel_tool_calls: bool = True,
                       prompt_text: str = "", forced: bool = False, named: str | None = None):
        """The streamed choices of each output: its new text and the logprobs not sent yet. With a reasoning
        parser, the text first goes through a ReasoningSplitter: reasoning as `reasoning_content` deltas, the rest
        on. With tools, that goes through a ToolCallParser: text that may be a call is held until it is known, and
        a call comes as a first delta with its id and name, then its arguments piece by piece as they are
        written; forced and named as for ToolCallParser."""
        sent_logprobs = [0] * n
        splitters = ([ReasoningSplitter(self.reasoning_parser, prompt_text) for _ in range(n)]
                     if self.reasoning_parser else None)
        parsers = [ToolCallParser(tool_names, forced, named) for _ in range(n)] if tool_names else None
        called = [False] * n

        def choices(_, out: RequestOutput):
            for comp in out.outputs:
                logprobs = None
                if comp.logprobs is not None and len(comp.logprobs) > sent_logprobs[comp.index]:
                    full = self._logprobs(comp, top_k)["content"]
                    logprobs = {"content": full[sent_logprobs[comp.index]:]}
                    sent_logprobs[comp.index] = len(full)
                finish_reason = comp.finish_reason
                text, deltas = comp.text_delta, []
                if splitters is not None:
                    split = splitters[comp.index].feed(text)
                    if comp.finished:
                        split += splitters[comp.index].finish()
                    text = split.content
                    deltas = [{"reasoning_content": split.reasoning}] if split.reasoning else []
                if parsers is None:
                    deltas += [{"content": text}] if text else []
                else:
                    events = parsers[comp.index].feed(text)
                    if comp.finished:
                        events += parsers[comp.index].finish()
                    deltas += _event_deltas(events, parallel_tool_calls)
                    called[comp.index] |= any("tool_calls" in delta for delta in deltas)
                    if called[comp.index]:
                        finish_reason = _calls_finish_reason(finish_reason)
                if not deltas and (comp.finished or logprobs is not None):
                    deltas = [{} if comp.finished else {"content": ""}]
                for i, delta in enumerate(deltas):
                    last = i == len(deltas) - 1
                    yield {"index": comp.index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                           "finish_reason": finish_reason if last else None}

        return choices

    def _logprobs(self, comp, top_k: int) -> dict | None:
        if comp.logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token_id, entry in zip(comp.token_ids, comp.logprobs):
            top = sorted(entry.values(), key=lambda lp: lp.rank)[:top_k]
            content.append(item(token_id, entry[token_id].logprob)
                           | {"top_logprobs": [item(lp.token_id, lp.logprob) for lp in top]})
        return {"content": content}


def _event_deltas(events: list, parallel_tool_calls: bool) -> list[dict]:
    """The stream's deltas for a ToolCallParser's events, in order: text as content, call pieces as tool_calls
    (only the first call when parallel_tool_calls is false, as the whole answer keeps)."""
    deltas = []
    for event in events:
        if isinstance(event, str):
            deltas.append({"content": event})
        elif parallel_tool_calls or event.index == 0:
            deltas.append({"tool_calls": [event.to_openai()]})
    return deltas


def _calls_finish_reason(finish_reason: str | None) -> str | None:
    """OpenAI's finish reason for an answer that ends in tool calls (one cut by max_tokens stays "length")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
