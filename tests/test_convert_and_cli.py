"""`qwenserve convert`, `generate` and `compare` end to end on tiny checkpoints."""
import json
import os

import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.entrypoints.cli.main import main
from qwenserve.tools.compare import compare_one, hf_greedy, load_hf_model

from helpers import save_gguf, save_hf_dir, tiny_hf_model

PROMPT_IDS = list(range(10, 30))


def _greedy(path: str, ids: list[int], n: int) -> list[int]:
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB")
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_convert_output_loads_in_hf_and_qwenserve_with_same_greedy_tokens(tmp_path, source):
    hf = tiny_hf_model(seed=21)
    src = (save_hf_dir(hf, str(tmp_path / "src")) if source == "hf"
           else save_gguf(hf, str(tmp_path / "src.gguf"), "Q8_0"))
    out = str(tmp_path / "converted")
    assert main(["convert", "--model", src, "--output", out, "--dtype", "float32"]) == 0
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))

    original = _greedy(src, PROMPT_IDS, 16)
    converted = _greedy(out, PROMPT_IDS, 16)
    assert converted == original
    assert hf_greedy(load_hf_model(out), PROMPT_IDS, 16)[0] == original

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_convert_refuses_to_overwrite(tmp_path, capsys):
    src = save_hf_dir(tiny_hf_model(seed=22), str(tmp_path / "src"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert main(["convert", "--model", src, "--output", str(tmp_path / "taken")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_generate_prints_the_greedy_completion(tmp_path, capsys):
    src = save_hf_dir(tiny_hf_model(seed=23), str(tmp_path / "src"))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok.encode("the cat", add_special_tokens=False)
    expected = hf_greedy(load_hf_model(src), ids, 8, {tok.convert_tokens_to_ids("<|im_end|>")})[0]  # ends at EOS
    assert main(["generate", "--model", src, "--prompt", "the cat", "--max-tokens", "8", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert printed == tok.decode(expected, skip_special_tokens=True) + "\n"


def test_generate_chat_and_sampling_flags_run(tmp_path, capsys):
    src = save_hf_dir(tiny_hf_model(seed=24), str(tmp_path / "src"))
    args = ["generate", "--model", src, "--prompt", "hi", "--chat", "--max-tokens", "6", "--temperature", "0.8",
            "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first  # same seed, same text


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "no such file or directory"),
    (["generate", "--model", "{src}", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "--model", "{src}", "--prompt", "x", "--max-model-len", "99999"], "max_model_len 99999"),
    (["generate", "--model", "{src}", "--prompt", "x", "--max-model-len", "16", "--max-tokens", "20"],
     "maximum context length is 16 tokens"),
    (["generate", "--model", "{src}", "--prompt", "x", "--kv-cache-memory", "lots"], "is not a size"),
    (["generate", "--model", "{src}", "--prompt", "", "--max-tokens", "2"], "the prompt is empty"),
])
def test_cli_errors_are_one_clear_line(tmp_path, capsys, argv, message):
    src = save_hf_dir(tiny_hf_model(seed=25), str(tmp_path / "src"))
    assert main([a.replace("{src}", src) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_compare_reports_equality_as_json(tmp_path, capsys):
    src = save_hf_dir(tiny_hf_model(seed=26), str(tmp_path / "src"))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["the weather", {"messages": [{"role": "user", "content": "hello"}]}]))
    assert main(["compare", "--model", src, "--prompts", str(prompts), "--max-tokens", "12", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["all_equal"] is True
    assert len(report["prompts"]) == 2
    for p in report["prompts"]:
        assert p["hf_tokens"] == p["qwenserve_tokens"] and p["first_divergence"] is None
        assert p["max_logit_diff"] < 1e-4 and p["steps_compared"] == len(p["hf_tokens"])


def test_compare_finds_first_divergence():
    a, b = torch.zeros(5), torch.zeros(5)
    b2 = b.clone()
    b2[3] = 0.5
    r = compare_one("p", [1, 2, 3, 4], [a, a, a, a], [1, 2, 9, 4], [b, b, b2, b])
    assert not r.equal and r.first_divergence == 2 and r.steps_compared == 3 and r.max_logit_diff == 0.5
    r = compare_one("p", [1, 2], [a, a], [1, 2, 3], [b, b, b])
    assert not r.equal and r.first_divergence == 2


@pytest.mark.slow
def test_chat_streams_replies_and_keeps_the_conversation(tmp_path):
    import io

    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.entrypoints.cli.chat import run_chat
    src = save_hf_dir(tiny_hf_model(seed=27), str(tmp_path / "src"))
    turns = iter(["hello", "", "and again", "/exit"])
    out = io.StringIO()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    conv = run_chat(EngineConfig.from_kwargs(model=src, dtype="float32", kv_cache_memory="4MiB"), params, "be brief",
                    read=lambda prompt: next(turns), out=out)
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user", "assistant"]
    # the first reply equals a one-off greedy chat completion of the same conversation
    llm = LLM(src, dtype="float32", kv_cache_memory="4MiB")
    expected = llm.chat(conv[:2], params, use_tqdm=False)[0].outputs[0].text
    assert conv[2]["content"] == expected and expected in out.getvalue()
