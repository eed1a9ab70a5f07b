"""What the OpenAI endpoints share: errors, admitting a request's prompts, running them to the end or streaming
them as server-sent events, usage, and recording finished requests in the metrics."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from qwenserve.config.errors import RequestError
from qwenserve.engine.async_engine import AsyncLLMEngine, DrainingError, EngineDeadError, OverloadedError
from qwenserve.engine.llm_engine import GrammarBrokenError
from qwenserve.engine.outputs import RequestOutput
from qwenserve.entrypoints.openai.metrics import ServerMetrics
from qwenserve.entrypoints.openai.protocol import GUIDED
from qwenserve.lora.request import LoRARequest
from qwenserve.model.loader.tokenizer import chat_prompt_text
from qwenserve.sample.grammar import check_constraint
from qwenserve.sample.structured_outputs import FIELD as STRUCTURED_OUTPUTS

RETRY_AFTER_S = "1"
request_logger = logging.getLogger("qwenserve.requests")  # prompts and outputs: only with --log-requests


class ClientDisconnected(Exception):
    """The client went away before its answer was ready (its requests are aborted; the access log says so)."""


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content=error_body(message, type_, param, code))


def error_body(message: str, type_: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def public_message(e: Exception) -> str:
    """What a client may read of an engine failure: our own errors say what happened; anything else (a bug)
    only its type, since its text may hold file paths or internals (the log has the traceback)."""
    if isinstance(e, (APIError, RequestError, EngineDeadError, GrammarBrokenError)):
        return str(e)
    return f"the engine failed while running this request ({type(e).__name__}); see the server log"


def request_id(request: Request) -> str:
    """The id RequestContextMiddleware gave this request (the client's X-Request-Id, or a new one)."""
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


def engine_ids_prefix(request: Request, response_id: str) -> str:
    """What the engine's ids for this request's prompts start with (then -0, -1, ...): the response's id, plus a
    short random tail when the client chose the id, so that a retry carrying the same X-Request-Id (proxies keep
    it) never collides with the request still being aborted."""
    if getattr(request.state, "request_id_from_client", False):
        return f"{response_id}-{uuid.uuid4().hex[:6]}"
    return response_id


def record_usage(request: Request, body: dict) -> None:
    """Leave the request's token counts where the access log reads them."""
    request.state.usage = body


def chat_text(tokenizer, messages, add_generation_prompt: bool, tools: list[dict] | None = None,
              template_kwargs: dict | None = None, continue_final_message: bool = False) -> str:
    """The prompt of a conversation (with the tools shown, if any); one the chat template cannot render is the
    messages' fault, or chat_template_kwargs' where the request gave some."""
    plain = [_template_message(i, m) for i, m in enumerate(messages)]
    try:
        return chat_prompt_text(tokenizer, plain, add_generation_prompt, tools, template_kwargs,
                                continue_final_message)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    except Exception as e:  # jinja2's errors for a template variable the request set to something it cannot use
        if not template_kwargs:
            raise
        raise APIError(400, f"the chat template failed with chat_template_kwargs {sorted(template_kwargs)}: {e}",
                       param="chat_template_kwargs") from e


def _template_message(index: int, message) -> dict:
    """A message as chat templates take it: an assistant's tool calls with their arguments as objects (OpenAI
    sends them as JSON text; Qwen's template writes them with tojson), its reasoning under both of vLLM's names
    (Qwen3's template renders `reasoning_content` of the turns after the last user query), a tool result with
    its call's id."""
    out = {"role": message.role, "content": message.text()}
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if message.role == "assistant" and reasoning is not None:
        out["reasoning_content"] = out["reasoning"] = reasoning
    extra = message.model_extra or {}
    if message.role == "assistant" and extra.get("tool_calls"):
        calls = []
        for call in extra["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                    or not isinstance(arguments, dict):
                raise APIError(400, f"messages[{index}].tool_calls: each needs a function with a name and "
                                    "arguments as a JSON object", param="messages")
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function["name"], "arguments": arguments}})
        out["tool_calls"] = calls
    if message.role == "tool" and "tool_call_id" in extra:
        out["tool_call_id"] = extra["tool_call_id"]
    return out


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


Admitted = list[tuple[str, asyncio.Queue]]  # (request id, its output stream) for each prompt of a request


class OpenAIServing:
    """The base of the generating endpoints (completions, chat)."""
    DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
    PROMPT_PARAM = "prompt"  # the request field an engine complaint about the prompt is reported against

    def __init__(self, engine: AsyncLLMEngine, models, metrics: ServerMetrics, max_n: int,
                 log_requests: bool = False):
        self.engine = engine
        self.models = models
        self.metrics = metrics
        self.max_n = max_n
        self.log_requests = log_requests
        self.tokenizer = engine.tokenizer
        self.defaults = engine.generation_defaults

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bad_request(self, e: ValueError, body=None) -> APIError:
        """A RequestError names the field at fault (a constraint's, as the request gave it: response_format or
        structured_outputs); any other ValueError names none."""
        param = e.param if isinstance(e, RequestError) else None
        message = str(e)
        if param == "prompt":
            param = self.PROMPT_PARAM
        elif param == STRUCTURED_OUTPUTS and body is not None and body.constraint_field != STRUCTURED_OUTPUTS:
            param = body.constraint_field
            if param == "tool_choice":  # the constraint is the calls' grammar, made of the tools' parameters
                return APIError(400, f"tools: the tools' parameters cannot be enforced as tool_choice asks ({message})",
                                param="tools")
            if param.startswith(GUIDED):  # guided_regex: its constraint is structured_outputs.regex
                inner = f"{STRUCTURED_OUTPUTS}.{param[len(GUIDED):]}"
                return APIError(400, param + message[len(inner):] if message.startswith(inner) else message,
                                param=param)
            for inner, outer in ((f"{STRUCTURED_OUTPUTS}.json_object", param),
                                 (f"{STRUCTURED_OUTPUTS}.json", f"{param}.json_schema.schema"),
                                 (STRUCTURED_OUTPUTS, param)):
                if message.startswith(inner):
                    message = outer + message[len(inner):]
                    break
        return APIError(400, message, param=param)

    def _params(self, body, **known):
        """The body's SamplingParams; known: what the endpoint knows that the body needs (chat: the tokenizer's
        tool-call tag ids)."""
        try:
            return body.sampling_params(self.defaults, **known)
        except ValueError as e:
            raise self._bad_request(e, body) from e

    def _check_fan_out(self, prompt_lens: list[int], params) -> None:
        """Refuse (400, before anything is queued) a request with a prompt whose samples could never run: n over
        --max-n or over the sequences the batch holds (--max-num-seqs), or a prompt plus max_tokens for each of
        its n samples (which share the prompt's blocks) over the whole KV cache. Each prompt of a batch is its
        own engine request: together they may queue."""
        n, engine = params.n, self.engine
        if n > self.max_n:
            raise APIError(400, f"n must be at most {self.max_n} on this server (--max-n), got {n}", param="n")
        if n > engine.max_num_seqs:
            raise APIError(400, f"n={n} samples of one prompt are more than the {engine.max_num_seqs} sequences this "
                                f"server runs at once (--max-num-seqs)", param="n")

        def max_tokens(prompt_len: int) -> int:  # unset: up to the context length, as the engine resolves it
            return params.max_tokens if params.max_tokens is not None else max(engine.max_model_len - prompt_len, 0)
        longest = max(prompt_lens, key=lambda p: p + n * max_tokens(p))
        need = longest + n * max_tokens(longest)
        if need > engine.kv_cache_tokens:
            raise APIError(400, f"this request could never fit in the KV cache: {longest} prompt tokens + n={n} x "
                                f"{max_tokens(longest)} max_tokens = {need} tokens, and the whole cache holds "
                                f"{engine.kv_cache_tokens}; lower n or max_tokens",
                           param="n" if n > 1 else "max_tokens")

    async def _admit(self, prompts: list[dict], params, prefix: str, body=None,
                     lora_request: LoRARequest | None = None) -> Admitted:
        """Admit every prompt before answering, so a bad one is a 400 (and admits none of the others). Each
        prompt comes tokenized ({"prompt_token_ids": ...}, and "prompt" with its text) so its fit is known first.
        lora_request: the adapter the request's `model` names (None: the base model)."""
        self._check_fan_out([len(p["prompt_token_ids"]) for p in prompts], params)
        admitted = []
        try:
            if params.structured_outputs is not None:  # here, off the engine thread (which then finds it checked)
                await asyncio.to_thread(check_constraint, params.structured_outputs)
            for i, prompt in enumerate(prompts):
                rid = f"{prefix}-{i}"
                admitted.append((rid, await self.engine.add_request(rid, prompt, params, lora_request)))
                if self.log_requests:
                    request_logger.info("request %s: prompt %r, prompt_token_ids %s, params %s", rid,
                                        prompt.get("prompt"), prompt["prompt_token_ids"], params)
        except (ValueError, OverloadedError) as e:
            for rid, _ in admitted:
                self.engine.abort(rid)
            if isinstance(e, OverloadedError):  # a full queue, or a server shutting down: retry later
                type_ = "server_shutting_down" if isinstance(e, DrainingError) else "server_overloaded"
                raise APIError(503, str(e), type_, headers={"Retry-After": RETRY_AFTER_S}) from e
            raise self._bad_request(e, body) from e
        return admitted

    async def _outputs(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """One request's outputs; the one place a finished request is counted in the metrics (one the client
        left early is aborted, not finished)."""
        async for out in self.engine.stream(request_id, stream):
            if out.finished:
                self.metrics.record_finished(out)
                if self.log_requests:
                    request_logger.info("request %s finished: outputs %r, finish reasons %s", request_id,
                                        [c.text for c in out.outputs], [c.finish_reason for c in out.outputs])
            yield out

    async def _merged_outputs(self, admitted: Admitted) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every admitted request as they come, until all have finished; an engine
        failure is raised. Leaving early (client gone, task cancelled) aborts whatever is still running."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, request_id, stream):
            try:
                async for out in self._outputs(request_id, stream):
                    await queue.put((i, out))
            except Exception as e:  # noqa: BLE001 - an engine failure, raised to the reader below
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, r, s)) for i, (r, s) in enumerate(admitted)]
        try:
            unfinished = len(admitted)
            while unfinished:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                yield i, out
                if out.finished:
                    unfinished -= 1
        finally:
            for t in tasks:  # client gone or done: the engine aborts whatever is still running
                t.cancel()

    async def _run(self, admitted: Admitted, request: Request) -> list[RequestOutput]:
        """Every admitted request to its end; a client that goes away aborts them all (ClientDisconnected)."""
        async def finals():
            last = {}
            async for i, out in self._merged_outputs(admitted):
                last[i] = out
            return [last[i] for i in range(len(admitted))]

        task = asyncio.ensure_future(finals())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self.DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    raise ClientDisconnected
            try:
                outs = task.result()
            except (APIError, EngineDeadError):
                raise
            except RequestError as e:  # the request's own fault found after admission (a grammar that will not compile)
                raise self._bad_request(e) from e
            except Exception as e:  # noqa: BLE001 - a failed step (the engine logged it): a 500 that says little
                raise APIError(500, public_message(e), "server_error") from e
            record_usage(request, usage(outs))
            return outs
        finally:
            task.cancel()

    def _stream(self, request: Request, header: dict, admitted: Admitted, body,
                choices: Callable[[int, RequestOutput], Iterable[dict]], first: Iterable[dict] = ()
                ) -> StreamingResponse:
        """Server-sent events: a chunk (header + one choice) for each of `first`, then for each choice that
        `choices(prompt index, output)` makes of the outputs as they come, the usage chunk if the request asked
        for it, and [DONE]."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            outputs = self._merged_outputs(admitted)
            latest = {}  # each prompt's last output: its final one once the loop ends
            try:
                for choice in first:
                    yield sse(header | {"choices": [choice]})
                async for i, out in outputs:
                    for choice in choices(i, out):
                        yield sse(header | {"choices": [choice]})
                    latest[i] = out
                if include_usage:
                    yield sse(header | {"choices": [], "usage": usage(list(latest.values()))})
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - an engine failure mid-stream: the status is already sent
                yield sse(error_body(public_message(e), "server_error"))
            finally:
                if latest:  # so far, if the client left
                    record_usage(request, usage(list(latest.values())))
                await outputs.aclose()  # client gone: abort the requests now, not when the generator is collected

        return StreamingResponse(events(), media_type="text/event-stream")
