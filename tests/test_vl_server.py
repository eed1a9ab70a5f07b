"""Images through the OpenAI server, with the real openai client, on a tiny random Qwen2-VL checkpoint: a data: URL
gives the offline API's greedy tokens (and transformers' generate's); remote URLs are fetched from a local HTTP
server only for --allowed-media-domains (redirects checked again, a timeout and a size limit, the event loop free
meanwhile); file:// only under --allowed-local-media-path; every bad part is a 400 naming it; usage counts the
image's placeholder tokens; /tokenize gives the ids the chat endpoint runs, images and videos included, under the
same rules; nothing is left behind in the KV cache. Offline, LLM.chat follows the same rules."""
import asyncio
import base64
import http.server
import io
import threading
import time

import httpx
import openai
import pytest
from helpers import hold_engine_thread, live_server, save_hf_dir, tiny_hf_model, wait_idle_and_clean
from vl_helpers import IMAGE, data_url, hf_greedy, random_image, save_hf_vl_dir, tiny_hf_vl_model

from qwenserve import LLM, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app

MAX_TOKENS = 6
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
SLOW_S = 3.0  # the slow route's delay, beyond the server's fetch timeout


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def media_host():
    """A local HTTP server: /cat.png, /text (text/plain), /big (over the size limit), /slow (past the timeout),
    /missing (404), /redirect (to the same image on a host that is not allowed). Yields (port, the image)."""
    image = random_image(60, 90, seed=7)
    body = png_bytes(image)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            port = self.server.server_address[1]
            routes = {"/cat.png": ("image/png", body), "/text": ("text/plain", b"hello"),
                      "/big": ("image/png", body + b"\0" * 300_000)}
            if self.path == "/slow":
                time.sleep(SLOW_S)
                self._send("image/png", body)
            elif self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/cat.png")
                self.end_headers()
            elif self.path in routes:
                self._send(*routes[self.path])
            else:
                self.send_error(404)

        def _send(self, content_type, data):
            try:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (the size limit, the timeout)
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], image
    server.shutdown()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    hf = tiny_hf_vl_model("qwen2_vl", seed=1)
    return hf, save_hf_vl_dir(hf, str(tmp_path_factory.mktemp("vl")))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """(allowed directory, a PNG inside it, a PNG outside it)."""
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    inside, outside = root / "allowed" / "in.png", root / "out.png"
    inside.write_bytes(png_bytes(random_image(150, 100, seed=8)))
    outside.write_bytes(png_bytes(random_image(150, 100, seed=8)))
    return root / "allowed", inside, outside


ENGINE = dict(dtype="float32", kv_cache_memory="32MiB", limit_mm_per_prompt='{"image": 2}',
              allowed_media_domains=["127.0.0.1"], media_fetch_timeout=1.0, max_media_bytes="200KiB")


@pytest.fixture(scope="module")
def server(vl_dir, media_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=vl_dir[1], allowed_local_media_path=str(
        media_dir[0]), **ENGINE)))
    with live_server(build_app(engine, ["vl"])) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_data_url_equals_offline_api_and_transformers(server, client, vl_dir, media_host):
    hf, path = vl_dir
    _, image = media_host
    messages = user("what is ", image_part(data_url(image)), " here?")
    out = client.chat.completions.create(model="vl", messages=messages, **GREEDY)
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.choices[0].message.content == offline.outputs[0].text
    text = f"<|im_start|>user\nwhat is {IMAGE} here?<|im_end|>\n<|im_start|>assistant\n"
    assert list(offline.outputs[0].token_ids) == hf_greedy(hf, tok, text, [image], MAX_TOKENS)
    # usage counts the image's 6 placeholder tokens (60x90 -> 56x84 pixels -> 2x3 merged patches)
    assert out.usage.prompt_tokens == len(offline.prompt_token_ids) == len(tok.encode(text)) - 1 + 6
    assert out.usage.completion_tokens == MAX_TOKENS
    streamed = client.chat.completions.create(model="vl", messages=messages, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_remote_url_allowed_host_is_fetched(server, client, media_host):
    port, image = media_host
    by_url = client.chat.completions.create(
        model="vl", messages=user("see ", image_part(f"http://127.0.0.1:{port}/cat.png")), **GREEDY)
    by_data = client.chat.completions.create(model="vl", messages=user("see ", image_part(data_url(image))),
                                             **GREEDY)
    assert by_url.choices[0].message.content == by_data.choices[0].message.content
    assert by_url.usage.prompt_tokens == by_data.usage.prompt_tokens


def test_file_url_under_the_allowed_path(server, client, media_dir):
    allowed, inside, outside = media_dir
    ok = client.chat.completions.create(model="vl", messages=user(image_part(inside.as_uri())), **GREEDY)
    same = client.chat.completions.create(model="vl", messages=user(image_part(data_url(random_image(
        150, 100, seed=8)))), **GREEDY)
    assert ok.choices[0].message.content == same.choices[0].message.content
    assert ok.usage.prompt_tokens == same.usage.prompt_tokens


def bad_cases(port: int, media_dir) -> list:
    """(content parts, the part the 400 names, words its message holds)."""
    allowed, inside, outside = media_dir
    ok = data_url(random_image(40, 40))
    truncated = "data:image/png;base64," + base64.b64encode(png_bytes(random_image(40, 40))[:300]).decode()
    return [
        ([image_part(f"http://localhost:{port}/cat.png")], 0, "--allowed-media-domains"),
        ([image_part(f"http://127.0.0.1:{port}/redirect")], 0, "--allowed-media-domains"),
        ([image_part(f"http://127.0.0.1:{port}/text")], 0, "text/plain"),
        ([image_part(f"http://127.0.0.1:{port}/big")], 0, "--max-media-bytes"),
        ([image_part(f"http://127.0.0.1:{port}/missing")], 0, "HTTP 404"),
        (["a", image_part(outside.as_uri())], 1, "--allowed-local-media-path"),
        (["a", image_part(f"file://{allowed}/../out.png")], 1, "--allowed-local-media-path"),
        (["a", image_part(f"file://{allowed}/nope.png")], 1, "cannot be read"),
        (["a", image_part("data:image/png;base64,AAAA")], 1, "supported format"),
        (["a", image_part(truncated)], 1, "cannot be decoded"),
        (["a", image_part("data:image/png;base64,@@@")], 1, "invalid base64"),
        (["a", image_part("data:application/pdf;base64,AAAA")], 1, "unsupported media type"),
        (["a", image_part("data:image/svg+xml;base64," + "PHN2Zz48L3N2Zz4=")], 1, "supported format"),
        (["a", image_part("ftp://127.0.0.1/a.png")], 1, "data:, http(s):// or file://"),
        ([image_part(ok), image_part(ok), "and", image_part(ok)], 3, "--limit-mm-per-prompt"),
        (["a", {"type": "input_audio", "input_audio": {}}], 1, "supported:"),
        (["a", {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], 1, "video decoder"),
    ]


def test_bad_parts_are_400s_naming_the_part(server, media_host, media_dir):
    url, engine = server
    for parts, index, words in bad_cases(media_host[0], media_dir):
        messages = user(*parts)
        response = httpx.post(url + "/v1/chat/completions", json={"model": "vl", "messages": messages}, timeout=30)
        error = response.json()["error"]
        assert response.status_code == 400, (parts, response.text)
        assert error["param"] == f"messages[0].content[{index}]", (words, error)
        assert words in error["message"] and error["param"] in error["message"], (words, error)
    wait_idle_and_clean(engine)


def test_preprocessing_refusal_names_the_part_off_the_engine_thread(server, client):
    """An image refused by preprocessing (aspect ratio over 200) is a 400 naming its part, and leaves no blocks.
    Preprocessing runs in the server's worker thread: the answer comes while the engine's thread is held."""
    url, engine = server
    ok = image_part(data_url(random_image(40, 40)))
    with hold_engine_thread(engine):  # held for 30 s: an answer that needed the engine would time out first
        response = httpx.post(url + "/v1/chat/completions", timeout=10, json={
            "model": "vl", "messages": user("x", ok, image_part(data_url(random_image(2, 500))))})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages[0].content[2]"
    assert error["message"].startswith("messages[0].content[2]: an image's aspect ratio must be below 200")
    out = client.chat.completions.create(model="vl", messages=user("x", image_part(data_url(random_image(40, 40)))),
                                         **GREEDY)
    assert out.usage.completion_tokens == MAX_TOKENS
    wait_idle_and_clean(engine)


def test_a_slow_fetch_times_out_without_blocking_the_server(server, media_host):
    """The fetch runs in a thread: /health answers while it waits, and it ends at --media-fetch-timeout."""
    url, engine = server
    port = media_host[0]

    async def main():
        async with httpx.AsyncClient(timeout=30) as http:
            start = time.monotonic()
            chat = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json={
                "model": "vl", "messages": user(image_part(f"http://127.0.0.1:{port}/slow"))}))
            await asyncio.sleep(0.3)
            health = await http.get(url + "/health")
            health_s = time.monotonic() - start
            response = await chat
            return health, health_s, response, time.monotonic() - start
    health, health_s, response, total_s = asyncio.run(main())
    assert health.status_code == 200 and health_s < 0.9  # while the fetch waits for its 1 s timeout
    assert response.status_code == 400 and "--media-fetch-timeout" in response.json()["error"]["message"]
    assert total_s < SLOW_S
    wait_idle_and_clean(engine)


def test_completions_take_no_images(server):
    """As vLLM: /v1/completions carries no media; a prompt with an image placeholder and no image is a 400."""
    url, _ = server
    response = httpx.post(url + "/v1/completions", timeout=30,
                          json={"model": "vl", "prompt": f"x {IMAGE}", "max_tokens": 2})
    assert response.status_code == 400 and "no images" in response.json()["error"]["message"]


def tokenize(url: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(url + "/tokenize", json={"model": "vl", "messages": messages}, timeout=30)


def expanded(tok, text: str, counts: list[int], pad: str = "<|image_pad|>") -> list[int]:
    """The ids of a prompt whose placeholders (IMAGE, or the video's with pad) hold counts[i] pad tokens each."""
    marker = IMAGE.replace("<|image_pad|>", pad)
    pieces = text.split(marker)
    assert len(pieces) == len(counts) + 1
    full = pieces[0] + "".join(marker.replace(pad, pad * n) + piece for n, piece in zip(counts, pieces[1:]))
    return tok.encode(full, add_special_tokens=False)


@pytest.fixture
def admitted_ids(server, monkeypatch) -> list[list[int]]:
    """The prompt ids of each request the engine admits while the test runs, in order."""
    processor = server[1].engine.input_processor
    process, seen = processor.process, []

    def recording(*args, **kwargs):
        request = process(*args, **kwargs)
        seen.append(request.prompt_token_ids)
        return request
    monkeypatch.setattr(processor, "process", recording)
    return seen


def test_tokenize_counts_images_as_the_chat_prompt_does(server, client, admitted_ids):
    """/tokenize with image parts gives the ids the chat endpoint runs for the same messages: each placeholder
    expanded to its image's tokens after the smart resize and the 2x2 merge, as usage and the engine count them."""
    url, engine = server
    tok = engine.tokenizer
    # 60x90 -> 56x84 pixels -> 2x3 merged patches: 6 tokens; 150x100 -> 140x112 -> 5x4: 20 tokens
    small, large = image_part(data_url(random_image(60, 90, seed=7))), image_part(data_url(random_image(150, 100)))
    cases = [(user("what is ", small, " here?"), f"what is {IMAGE} here?", [6]),
             (user(small, "then", large, "?"), f"{IMAGE}then{IMAGE}?", [6, 20]),
             (user(large, "then", small), f"{IMAGE}then{IMAGE}", [20, 6])]
    for messages, text, counts in cases:
        response = tokenize(url, messages)
        assert response.status_code == 200, response.text
        body = response.json()
        chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        assert body["tokens"] == expanded(tok, chat, counts)
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == engine.max_model_len
        out = client.chat.completions.create(model="vl", messages=messages, **GREEDY)
        assert out.usage.prompt_tokens == body["count"]
        assert admitted_ids[-1] == body["tokens"]
    # without the generation prompt, as for text
    response = httpx.post(url + "/tokenize", timeout=30, json={"messages": cases[0][0], "add_generation_prompt": False})
    assert response.json()["tokens"] == expanded(tok, f"<|im_start|>user\nwhat is {IMAGE} here?<|im_end|>\n", [6])
    wait_idle_and_clean(engine)


def test_tokenize_counts_a_video_as_the_chat_prompt_does(server, client, admitted_ids):
    """A video_url part's frames: 2 frames of 60x90 resized to at least 128 x 28 x 28 pixels (280x392) are one
    temporal patch of 20x28 patches: 140 <|video_pad|> tokens, as the engine runs them."""
    url, engine = server
    frames = [data_url(random_image(60, 90, seed=s)) for s in (1, 2)]
    messages = user({"type": "video_url", "video_url": {"url": frames}}, "what happens?")
    body = tokenize(url, messages).json()
    text = f"<|im_start|>user\n{IMAGE.replace('image', 'video')}what happens?<|im_end|>\n<|im_start|>assistant\n"
    assert body["tokens"] == expanded(engine.tokenizer, text, [140], pad="<|video_pad|>")
    out = client.chat.completions.create(model="vl", messages=messages, **GREEDY)
    assert out.usage.prompt_tokens == body["count"] and admitted_ids[-1] == body["tokens"]
    wait_idle_and_clean(engine)


def test_tokenize_refuses_bad_parts_as_chat_does(server, media_host, media_dir):
    """Every bad part chat refuses (hosts, local paths, the limit, decoding, preprocessing) is the same 400 from
    /tokenize, naming the part; a fetch from an allowed host and a file under the allowed path count as chat does."""
    url, engine = server
    port, image = media_host
    _, inside, _ = media_dir
    cases = bad_cases(port, media_dir) + [
        (["x", image_part(data_url(random_image(2, 500)))], 1, "aspect ratio must be below 200")]
    for parts, index, words in cases:
        response = tokenize(url, user(*parts))
        chat = httpx.post(url + "/v1/chat/completions", json={"model": "vl", "messages": user(*parts)}, timeout=30)
        assert response.status_code == 400, (parts, response.text)
        assert response.json()["error"] == chat.json()["error"]
        error = response.json()["error"]
        assert error["param"] == f"messages[0].content[{index}]", (words, error)
        assert words in error["message"] and error["param"] in error["message"], (words, error)
    by_url = tokenize(url, user("see ", image_part(f"http://127.0.0.1:{port}/cat.png"))).json()
    assert by_url["tokens"] == tokenize(url, user("see ", image_part(data_url(image)))).json()["tokens"]
    by_file = tokenize(url, user(image_part(inside.as_uri()))).json()["tokens"]
    assert by_file == tokenize(url, user(image_part(data_url(random_image(150, 100, seed=8))))).json()["tokens"]
    wait_idle_and_clean(engine)


def test_text_only_model_refuses_image_parts(tmp_path):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(
        model=save_hf_dir(tiny_hf_model(seed=3), str(tmp_path)), dtype="float32", kv_cache_memory="8MiB")))
    try:
        with live_server(build_app(engine, ["text"])) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="text", messages=user(
                    "describe", image_part(data_url(random_image(40, 40)))), max_tokens=2)
            error = e.value.body
            assert error["param"] == "messages[0].content[1]" and "text-only" in error["message"]
            ok = client.chat.completions.create(model="text", messages=user("plain ", "text"), max_tokens=2)
            assert ok.usage.completion_tokens <= 2
            response = httpx.post(url + "/tokenize", timeout=30, json={"messages": user(
                "describe", image_part(data_url(random_image(40, 40))))})
            assert response.status_code == 400 and response.json()["error"] == error
            text = httpx.post(url + "/tokenize", timeout=30, json={"messages": user("plain ", "text")}).json()
            assert text["count"] == ok.usage.prompt_tokens
    finally:
        engine.shutdown()


def test_offline_chat_follows_the_same_media_rules(vl_dir, media_host, media_dir):
    """LLM.chat fetches and reads URLs under the same settings: allowed ones give the data: URL's tokens, the
    others are a RequestError naming the part and the setting."""
    from qwenserve.config.errors import RequestError
    port, image = media_host
    allowed, inside, outside = media_dir
    llm = LLM(vl_dir[1], allowed_local_media_path=str(allowed), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def tokens(url):
        return list(llm.chat(user("see ", image_part(url)), params, use_tqdm=False)[0].outputs[0].token_ids)
    assert tokens(f"http://127.0.0.1:{port}/cat.png") == tokens(data_url(image))
    assert tokens(inside.as_uri()) == tokens(data_url(random_image(150, 100, seed=8)))
    for url, flag in ((f"http://localhost:{port}/cat.png", "--allowed-media-domains"),
                      (outside.as_uri(), "--allowed-local-media-path")):
        with pytest.raises(RequestError, match=r"messages\[0\]\.content\[1\].*" + flag) as e:
            tokens(url)
        assert e.value.param == "messages[0].content[1]"
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
