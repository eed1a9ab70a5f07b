"""LoRA adapters through the OpenAI server, live on a loopback port, driven by the official openai client: the
request's `model` names an adapter (--lora-modules, or loaded while serving), /v1/models lists them, adapters are
loaded and unloaded, every bad adapter is a 400 that names the problem, /metrics counts requests per adapter, and
the server's answers are the offline API's with the same LoRARequest. Adapters are written by PEFT itself."""
import asyncio
import json
import os
import shutil

import httpx
import openai
import pytest
import torch

from qwenserve import LLM, LoRARequest, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.config.server_config import LoRAModulePath, parse_lora_module
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app

from helpers import live_server, metric_value, save_hf_dir, tiny_hf_model, wait_idle_and_clean
from test_lora import ADAPTERS, make_adapter

KEY = "lora-key"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
OFFLINE_GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(base model directory, {adapter name: its directory}): "attn" and "mlp" served from the start, "all" and
    "qvd" for loading while serving."""
    hf = tiny_hf_model(seed=71, max_position_embeddings=256)
    base = save_hf_dir(hf, str(tmp_path_factory.mktemp("lora-srv-base")))
    paths = {}
    for i, (name, config) in enumerate([("attn", ADAPTERS["attn"]), ("mlp", ADAPTERS["mlp"]),
                                        ("all", ADAPTERS["all-rslora"]), ("qvd", ADAPTERS["q-v-down"])]):
        paths[name] = str(tmp_path_factory.mktemp(f"lora-srv-{name}"))
        make_adapter(hf, paths[name], seed=300 + i, **config)
    return base, paths


@pytest.fixture(scope="module")
def server(files):
    base, paths = files
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=base, **ENGINE)))
    modules = (parse_lora_module(f"attn={paths['attn']}"),
               parse_lora_module(json.dumps({"name": "mlp", "path": paths["mlp"], "base_model_name": "upstream"})))
    app = build_app(engine, ["tiny"], api_key=KEY, lora_modules=modules, allow_runtime_lora_updating=True)
    with live_server(app) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(files):
    """The offline API on the same model: what the server must answer."""
    return LLM(files[0], **ENGINE)


def post(server, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server[0] + route, json=body, headers=headers, timeout=30)


def offline_text(offline, prompt: str, adapter: LoRARequest | None, max_tokens: int = 12) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate(prompt, params, use_tqdm=False, lora_request=adapter)[0].outputs[0].text


def completion(client, model: str, prompt: str, max_tokens: int = 12):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **GREEDY)


# ---- the request's model names the adapter ---------------------------------------------------------------------

def test_adapter_by_model_name_equals_the_offline_api(client, offline, files, server):
    paths = files[1]
    prompt = "the adapter says"
    answers = {}
    for name in ("attn", "mlp", "tiny"):
        answers[name] = completion(client, name, prompt).choices[0].text
        assert completion(client, name, prompt).model_dump()["model"] == name
    # ids differ from the server's: an id is the engine's own name for an adapter, the answer does not depend on it
    assert answers["attn"] == offline_text(offline, prompt, LoRARequest("attn", 1, paths["attn"]))
    assert answers["mlp"] == offline_text(offline, prompt, LoRARequest("mlp", 2, paths["mlp"]))
    assert answers["tiny"] == offline_text(offline, prompt, None)
    assert len(set(answers.values())) == 3, "each adapter should change the answer"
    wait_idle_and_clean(server[1])


def test_chat_and_streaming_with_an_adapter(client, offline, files):
    messages = [{"role": "user", "content": "hello adapter"}]
    chat = client.chat.completions.create(model="mlp", messages=messages, max_tokens=10, **GREEDY)
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False, lora_request=LoRARequest("mlp", 2, files[1]["mlp"]))[0]
    assert chat.choices[0].message.content == expected.outputs[0].text
    streamed = client.chat.completions.create(model="mlp", messages=messages, max_tokens=10, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.outputs[0].text
    base = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, **GREEDY)
    assert base.choices[0].message.content != chat.choices[0].message.content


def test_models_lists_the_adapters_with_their_parent(client, files):
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert list(cards)[:3] == ["tiny", "attn", "mlp"]
    assert cards["attn"]["parent"] == "tiny" and cards["attn"]["root"] == files[1]["attn"]
    assert cards["mlp"]["parent"] == "upstream" and cards["mlp"]["root"] == files[1]["mlp"]
    assert "parent" not in cards["tiny"]


def test_unknown_model_is_404_naming_the_served_ones(server):
    r = post(server, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "tiny, attn, mlp" in err["message"]


def test_prefix_cache_never_shares_blocks_across_adapters(client, offline, files, server):
    """The same long prompt to two adapters and the base model: each gets its own answer (the offline API's)
    and none reuses another's KV blocks; the same adapter again reuses its own."""
    prompt = "a shared prefix that fills blocks " * 3
    paths = files[1]
    expected = {"attn": offline_text(offline, prompt, LoRARequest("attn", 1, paths["attn"]), 4),
                "mlp": offline_text(offline, prompt, LoRARequest("mlp", 2, paths["mlp"]), 4),
                "tiny": offline_text(offline, prompt, None, 4)}
    for name in ("attn", "mlp", "tiny"):
        out = completion(client, name, prompt, 4)
        assert out.choices[0].text == expected[name], name
        assert out.usage.prompt_tokens_details.cached_tokens == 0, f"{name} reused another model's blocks"
    again = completion(client, "mlp", prompt, 4)
    assert again.choices[0].text == expected["mlp"]
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    wait_idle_and_clean(server[1])


# ---- loading and unloading while serving -------------------------------------------------------------------------

def test_load_use_unload_then_404(client, server, files, offline):
    paths = files[1]
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": paths["all"]},
                key=None).status_code == 401, "the load route needs the API key like every /v1 route"
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": paths["all"]})
    assert r.status_code == 200 and "'all'" in r.text
    assert "all" in [m.id for m in client.models.list().data]
    prompt = "loaded while serving"
    text = completion(client, "all", prompt).choices[0].text
    assert text == offline_text(offline, prompt, LoRARequest("all", 3, paths["all"]))
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "all"})
    assert r.status_code == 200 and "'all'" in r.text
    assert "all" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError, match="`all` does not exist"):
        completion(client, "all", prompt)
    # the name is free again, for the same adapter or another one; its answer is that adapter's, fresh
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": paths["qvd"]})
    assert r.status_code == 200, r.text
    assert completion(client, "all", prompt).choices[0].text == offline_text(
        offline, prompt, LoRARequest("qvd", 4, paths["qvd"]))
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "all"}).status_code == 200
    wait_idle_and_clean(server[1])


def test_unloading_an_adapter_in_use_lets_its_requests_finish(server, client, files, offline):
    paths = files[1]
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": paths["qvd"]}).status_code == 200
    prompt = "still running"

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
        stream = await aclient.completions.create(model="busy", prompt=prompt, max_tokens=200, stream=True,
                                                  **GREEDY)
        chunks = [await stream.__anext__()]
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient() as http:
            unloaded = await http.post(server[0] + "/v1/unload_lora_adapter", json={"lora_name": "busy"},
                                       headers=headers)
            metrics = (await http.get(server[0] + "/metrics", headers=headers)).text
        async for chunk in stream:
            chunks.append(chunk)
        return unloaded, metrics, chunks
    unloaded, metrics, chunks = asyncio.run(run())
    assert unloaded.status_code == 200
    assert metric_value(metrics, "qwenserve:lora_num_requests_running", lora_name="busy") == 1, \
        "the request should still run once its adapter is unloaded"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_text(offline, prompt, LoRARequest("qvd", 4, paths["qvd"]), 200)
    with pytest.raises(openai.NotFoundError):
        completion(client, "busy", prompt)
    wait_idle_and_clean(server[1])


@pytest.fixture(scope="module")
def broken(files, tmp_path_factory):
    """A factory of broken adapter directories: a copy of "attn" with its config edited or tensors replaced."""
    root = tmp_path_factory.mktemp("lora-srv-broken")

    def make(name, config=None, tensors=None):
        path = str(root / name)
        shutil.copytree(files[1]["attn"], path)
        if config is not None:
            file = os.path.join(path, "adapter_config.json")
            with open(file) as f:
                cfg = json.load(f)
            with open(file, "w") as f:
                json.dump(cfg | config, f)
        if tensors is not None:
            file = os.path.join(path, "adapter_model.safetensors")
            from safetensors.torch import load_file, save_file
            if tensors == "truncate":
                size = os.path.getsize(file)
                with open(file, "r+b") as f:
                    f.truncate(size - 64)
            else:
                save_file(load_file(file) | tensors, file)
        return path
    return make


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
BAD_LOADS = {
    # name: (config edits, tensor edits, what the error must name)
    "dora": ({"use_dora": True}, None, "use_dora"),
    "modules-to-save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "bias": ({"bias": "all"}, None, "'bias'"),
    "rank-above-max": ({"r": 32}, None, "above max_lora_rank 8"),
    "wrong-shape": (None, {Q_A: torch.zeros(4, 32)}, "has shape (4, 32)"),
    "truncated": (None, "truncate", "cannot read adapter_model.safetensors"),
}


@pytest.mark.parametrize("case", sorted(BAD_LOADS))
def test_loading_a_bad_adapter_is_a_400_naming_the_problem(server, client, broken, case):
    config, tensors, named = BAD_LOADS[case]
    path = broken(case, config, tensors)
    r = post(server, "/v1/load_lora_adapter", {"lora_name": case, "lora_path": path})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert named in err["message"] and path in err["message"]
    assert err["param"] == "lora_path"
    assert case not in [m.id for m in client.models.list().data]
    assert completion(client, "attn", "still serving", 2).choices[0].finish_reason == "length"


def test_load_and_unload_errors(server, files, tmp_path):
    paths = files[1]
    cases = [
        ("/v1/load_lora_adapter", {"lora_name": "attn", "lora_path": paths["qvd"]}, "lora_name",
         "'attn' has already been loaded"),
        ("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": paths["qvd"]}, "lora_name",
         "base model's served name"),
        ("/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")}, "lora_path",
         "no such directory"),
        ("/v1/load_lora_adapter", {"lora_name": "nocfg", "lora_path": str(tmp_path)}, "lora_path",
         "adapter_config.json is missing"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path", "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, "lora_name", "'never-loaded' cannot be found"),
        ("/v1/unload_lora_adapter", {"lora_name": "tiny"}, "lora_name", "it is the base model"),
    ]
    for route, body, param, message in cases:
        r = post(server, route, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], (body, err)
    assert [m["id"] for m in httpx.get(server[0] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}
                                       ).json()["data"]] == ["tiny", "attn", "mlp"]
    wait_idle_and_clean(server[1])


def test_an_adapter_whose_files_break_after_loading_fails_its_request_only(server, client, broken):
    """Loading checks the files; a worker reads them at first use. If they broke in between, that request is a 400
    naming the adapter and the cause, and the server serves on."""
    from safetensors.torch import load_file, save_file
    path = broken("fragile")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "fragile", "lora_path": path}).status_code == 200
    file = os.path.join(path, "adapter_model.safetensors")
    save_file(load_file(file) | {Q_A: torch.zeros(4, 32)}, file)
    r = post(server, "/v1/completions", {"model": "fragile", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_request"
    assert "LoRA adapter 'fragile' could not be loaded" in err["message"] and "has shape (4, 32)" in err["message"]
    assert httpx.get(server[0] + "/health").status_code == 200
    assert completion(client, "attn", "still serving", 2).choices[0].finish_reason == "length"
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "fragile"}).status_code == 200
    wait_idle_and_clean(server[1])


def test_runtime_updating_routes_exist_only_when_allowed(files):
    base, paths = files
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=base, **ENGINE)))
    try:
        with live_server(build_app(engine, ["tiny"])) as url:
            r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": paths["attn"]})
            assert r.status_code == 404
            r = httpx.post(url + "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 404
    finally:
        engine.shutdown()


# ---- metrics -----------------------------------------------------------------------------------------------------

def test_metrics_count_requests_per_adapter(server):
    headers = {"Authorization": f"Bearer {KEY}"}

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
        stream = await aclient.completions.create(model="attn", prompt="metrics", max_tokens=200, stream=True,
                                                  **GREEDY)
        await stream.__anext__()
        async with httpx.AsyncClient() as http:
            during = (await http.get(server[0] + "/metrics", headers=headers)).text
        await stream.close()
        return during
    during = asyncio.run(run())
    assert metric_value(during, "qwenserve:lora_num_requests_running", lora_name="attn") == 1
    info = [line for line in during.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1
    assert 'running_lora_adapters="attn"' in info[0] and 'waiting_lora_adapters=""' in info[0]
    assert 'max_lora="2"' in info[0]
    wait_idle_and_clean(server[1])
    after = httpx.get(server[0] + "/metrics", headers=headers).text
    assert "qwenserve:lora_num_requests_running{" not in after
    assert 'running_lora_adapters=""' in after


# ---- settings ------------------------------------------------------------------------------------------------------

def test_lora_modules_values_are_parsed_or_named():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "q"}') == LoRAModulePath(
        "sql", "/a", "q")
    for bad, pattern in [("sql", "neither name=path nor JSON"), ("=/a", "has no name"), ("sql=", "has no path"),
                         ("{not json", "not valid JSON"), ('{"name": "a"}', "has no path"),
                         ('{"name": "a", "path": "/p", "rank": 4}', r"unknown keys \['rank'\]"),
                         ('["a"]', "neither name=path nor JSON")]:
        with pytest.raises(ConfigError, match=pattern):
            parse_lora_module(bad)


def test_serve_flags_for_lora(monkeypatch):
    from qwenserve.entrypoints.cli.main import build_parser
    from qwenserve.entrypoints.cli.serve import server_config_from_args
    parse = build_parser().parse_args
    monkeypatch.delenv("QWENSERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    config = server_config_from_args(parse(["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']))
    assert config.lora_modules == (LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y"))
    assert not config.allow_runtime_lora_updating
    assert server_config_from_args(parse(["serve", "--allow-runtime-lora-updating"])).allow_runtime_lora_updating
    monkeypatch.setenv("QWENSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert server_config_from_args(parse(["serve"])).allow_runtime_lora_updating
    assert not server_config_from_args(parse(["serve", "--no-allow-runtime-lora-updating"])
                                       ).allow_runtime_lora_updating
    monkeypatch.setenv("QWENSERVE_ALLOW_RUNTIME_LORA_UPDATING", "maybe")
    with pytest.raises(ConfigError, match="QWENSERVE_ALLOW_RUNTIME_LORA_UPDATING='maybe'"):
        server_config_from_args(parse(["serve"]))
    monkeypatch.delenv("QWENSERVE_ALLOW_RUNTIME_LORA_UPDATING")
    with pytest.raises(ConfigError, match=r"names \['a'\] more than once"):
        server_config_from_args(parse(["serve", "--lora-modules", "a=/x", "a=/y"]))


def test_serve_refuses_bad_lora_modules_at_start(files, capsys):
    """`qwenserve serve` stops before serving, with one line naming the module, when --lora-modules cannot be
    served."""
    from qwenserve.entrypoints.cli.main import main
    base, paths = files
    common = ["serve", "--model", base, "--dtype", "float32", "--kv-cache-memory", "2MiB", "--port", "0"]
    assert main(common + ["--lora-modules", f"a={paths['attn']}"]) == 2
    assert "--lora-modules a needs --enable-lora" in capsys.readouterr().err
    assert main(common + ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", "bad=/no/such/adapter"]) == 2
    err = capsys.readouterr().err
    assert "lora_modules bad=/no/such/adapter" in err and "no such directory" in err
    assert main(common + ["--enable-lora", "--max-lora-rank", "2", "--lora-modules", f"a={paths['attn']}"]) == 2
    assert "above max_lora_rank 2" in capsys.readouterr().err
    assert main(common + ["--lora-modules", "a"]) == 2
    assert "'a' is neither name=path nor JSON" in capsys.readouterr().err


@pytest.mark.multiproc
def test_serve_command_serves_lora_modules_and_runtime_updates(files, offline, tmp_path):
    """`qwenserve serve` as users start it: --lora-modules served by name, runtime loading turned on by its
    environment variable."""
    from helpers import serve_process
    base, paths = files
    args = ["--model", base, "--dtype", "float32", "--kv-cache-memory", "4MiB", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--served-model-name", "tiny", "--lora-modules", f"attn={paths['attn']}"]
    env = os.environ | {"QWENSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1", "QWENSERVE_CPU_KERNELS": "0"}
    env.pop("QWENSERVE_API_KEY", None)
    with serve_process(args, tmp_path / "serve.log", env) as (_, url):
        cli = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in cli.models.list().data] == ["tiny", "attn"]
        prompt = "from the command line"
        text = cli.completions.create(model="attn", prompt=prompt, max_tokens=12, **GREEDY).choices[0].text
        assert text == offline_text(offline, prompt, LoRARequest("attn", 1, paths["attn"]))
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": paths["mlp"]})
        assert r.status_code == 200, r.text
        text = cli.completions.create(model="mlp", prompt=prompt, max_tokens=12, **GREEDY).choices[0].text
        assert text == offline_text(offline, prompt, LoRARequest("mlp", 2, paths["mlp"]))
