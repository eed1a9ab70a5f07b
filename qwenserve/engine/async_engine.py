"""The engine for many concurrent callers: one background thread owns the LLMEngine and steps it while any
request is live; asyncio callers submit requests and read each request's outputs from its own stream.

Only the engine thread touches the engine. Callers send it commands (add, abort) through a thread-safe
queue and get validation errors back at once; outputs travel back through call_soon_threadsafe."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from qwenserve.engine.data_parallel import DataParallelEngine
from qwenserve.engine.llm_engine import LLMEngine, RequestsFailedError
from qwenserve.engine.outputs import RequestOutput
from qwenserve.executor.abstract import ExecutorDeadError
from qwenserve.lora.request import LoRARequest
from qwenserve.sample.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
UNHEALTHY_AFTER_FAILED_STEPS = 3  # failed steps in a row before /health says 503


class EngineDeadError(RuntimeError):
    pass


class OverloadedError(RuntimeError):
    """The waiting queue is full: the caller should retry later (HTTP 503)."""


class DrainingError(OverloadedError):
    """The server is shutting down and admits no new request: retry later, or on another replica (HTTP 503)."""


class DrainTimeoutError(EngineDeadError):
    """A request still running when the shutdown's drain deadline passed: it ends with this (HTTP 503)."""


@dataclass
class _Add:
    request_id: str
    prompt: object
    params: SamplingParams
    stream: "asyncio.Queue[RequestOutput | BaseException | None]"
    loop: asyncio.AbstractEventLoop
    done: concurrent.futures.Future
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: object
    done: concurrent.futures.Future


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | DataParallelEngine, max_waiting_requests: int | None = None):
        """max_waiting_requests bounds the queue of admitted requests not yet running; beyond it, new requests
        are refused with OverloadedError instead of piling up."""
        self.engine = engine
        # fixed at start, so callers on any thread may read them
        self.tokenizer = engine.tokenizer
        self.model_id = engine.model_id
        self.max_model_len = engine.max_model_len
        self.generation_defaults = engine.generation_defaults
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        self.kv_cache_tokens = engine.kv_cache_tokens  # the most one request's sequences can ever hold
        self.model_config = engine.resolved_model.config
        self.lora_config = engine.config.lora
        self.vision = engine.resolved_model.config.vision  # None: a text-only model
        self.multimodal = engine.config.multimodal  # media limits and where media may come from
        self.image_processor = engine.input_processor.image_processor  # stateless: callers preprocess in threads
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self._draining = threading.Event()  # set once by begin_drain(): refuse new requests, finish live ones
        self.consecutive_failed_steps = 0  # written by the engine thread only
        self._thread = threading.Thread(target=self._run, name="qwenserve-engine", daemon=True)
        self._thread.start()

    # ---- caller side ----------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt, params: SamplingParams,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """add_request, then stream."""
        stream = await self.add_request(request_id, prompt, params, lora_request)
        async for out in self.stream(request_id, stream):
            yield out

    async def stream(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs of one admitted request as they come; the last has finished=True. Leaving the loop early
        (client gone, task cancelled) aborts the request and frees its blocks."""
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          lora_request: LoRARequest | None = None) -> asyncio.Queue:
        """Admit a request (a bad one raises ValueError here) and return the queue its outputs arrive on.
        lora_request: the LoRA adapter it runs with; None: the base model."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Add(request_id, prompt, params, stream, loop, done, lora_request))
        await asyncio.wrap_future(done)  # raises the engine's ValueError for a bad request
        return stream

    def prompt_token_ids(self, prompt) -> list[int]:
        """The token ids the engine would run for `prompt` (add_request's form), its image and video placeholders
        expanded; on the caller's thread, without the engine's. Give images and videos preprocessed
        (ProcessedImage, from image_processor) so it stays cheap. A bad prompt raises RequestError."""
        return self.engine.input_processor.prompt_token_ids(prompt)  # reads only its fixed settings

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def stats(self) -> dict:
        """The engine's gauges (running, waiting, KV use, prefix hits, aborts), read between steps."""
        return await self.call(lambda engine: engine.stats())

    async def call(self, fn):
        """Run fn(engine) on the engine thread (for statistics that must not race with a step)."""
        return await asyncio.wrap_future(self._call(fn))

    def call_blocking(self, fn):
        """call() for code that is neither async nor on the engine thread (the server's setup, before serving)."""
        return self._call(fn).result()

    def _call(self, fn) -> concurrent.futures.Future:
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return done

    # ---- graceful shutdown: drain, then abort the rest -----------------------------------------------------

    def begin_drain(self) -> None:
        """Admit no new request from now on (DrainingError); the live ones run on."""
        self._draining.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def num_live_requests(self) -> int:
        """Admitted requests whose final output has not been delivered (a snapshot: the engine thread changes it)."""
        return len(self._streams)

    async def abort_all(self, error: Exception) -> int:
        """End every live request with `error` (its stream raises it) and free its blocks; returns how many."""
        def fail_all(_engine) -> int:
            live = len(self._streams)
            self._fail_all(error)
            return live
        return await self.call(fail_all) if self.alive else 0

    def _send(self, cmd) -> None:
        self._commands.put(cmd)
        if self._stopped.is_set():  # the engine thread may have left before it could see cmd
            self._refuse_pending()

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout=10)
        self.engine.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def healthy(self) -> bool:
        """Alive, and the last steps did not all fail (a few failures in a row mean a fault, not a bad batch)."""
        return self.alive and self.consecutive_failed_steps < UNHEALTHY_AFTER_FAILED_STEPS

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError("the engine is not running")

    # ---- engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                # block while idle; otherwise take what has arrived and step
                self._handle(self._commands.get() if not self.engine.has_unfinished_requests()
                             else self._commands.get_nowait())
                continue
            except queue.Empty:
                pass
            try:
                outputs = self.engine.step()
                self.consecutive_failed_steps = 0
            except RequestsFailedError as e:  # a failed step, a dead replica, bad grammars: fail those, serve the rest
                self.consecutive_failed_steps = self.consecutive_failed_steps + 1 if e.faulty_step else 0
                for out in e.outputs:
                    self._deliver(out.request_id, out, final=out.finished)
                for request_id, error in e.failures.items():
                    self._deliver(request_id, EngineDeadError(str(error)) if isinstance(error, ExecutorDeadError)
                                  else error, final=True)
                continue
            except ExecutorDeadError as e:  # a worker is gone: nothing more can run
                logger.error("engine stopped: %s; failing %d live requests", e, len(self._streams))
                self._fail_all(EngineDeadError(f"the engine stopped: {e}"))
                break
            except Exception as e:  # a bug, not a bad request: fail every live request, keep serving
                self.consecutive_failed_steps += 1
                logger.exception("engine step failed; aborting %d live requests", len(self._streams))
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out, final=out.finished)
        self._stopped.set()
        self._refuse_pending()

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            self._deliver(rid, error, final=True)

    def _refuse_pending(self) -> None:
        """Answer the commands that arrived as the engine stopped, so no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)) and not cmd.done.done():
                cmd.done.set_exception(EngineDeadError("the engine is not running"))

    def _handle(self, cmd) -> None:
        if cmd is None:
            return
        if isinstance(cmd, _Add):
            if self._draining.is_set():  # checked here, on the engine thread: nothing slips in after the flag
                cmd.done.set_exception(DrainingError("the server is shutting down and admits no new requests; "
                                                     "retry later or on another replica"))
                return
            waiting = self.engine.num_waiting_requests  # not sequences: a request's n samples count once
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                cmd.done.set_exception(OverloadedError(
                    f"the server is overloaded: {waiting} requests are already waiting (--max-waiting-requests "
                    f"{self.max_waiting_requests}); retry later"))
                return
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, lora_request=cmd.lora_request)
            except Exception as e:
                cmd.done.set_exception(e)
                return
            self._streams[cmd.request_id] = (cmd.loop, cmd.stream)
            cmd.done.set_result(None)
        elif isinstance(cmd, _Abort):
            if cmd.request_id in self._streams:
                self.engine.abort_request(cmd.request_id)
                self._streams.pop(cmd.request_id, None)
        elif isinstance(cmd, _Call):
            try:
                cmd.done.set_result(cmd.fn(self.engine))
            except Exception as e:
                cmd.done.set_exception(e)

    def _deliver(self, request_id: str, item, final: bool) -> None:
        target = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
