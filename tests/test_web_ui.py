"""The web UI (/) in a real browser: Debian's headless Chromium driven by selenium through the system chromedriver
(scripts/ensure_browser.sh installs both), against live servers on a tiny random model, and a tiny random Qwen2-VL
for images. Each test saves a screenshot into the directory it prints ($QWENSERVE_SCREENSHOTS, or a pytest
temporary directory), and checks that the page threw no error and broke no rule of its Content-Security-Policy.
The tiny models' answers are random text, so the renderer's own cases and a corpus of hostile answers
(hostile_markdown.py, audited by render_check.js) run in the page on given strings (render.js, the code the page
uses), and a served answer checks that what streams in is rendered as the whole answer would be."""
import base64
import io
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from qwenserve.config.engine_config import EngineConfig
from qwenserve.engine.async_engine import AsyncLLMEngine
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.openai.api_server import build_app

from helpers import live_server, metric_value, save_hf_dir, tiny_hf_model
from hostile_markdown import SENTINEL, corpus
from vl_helpers import random_image, save_hf_vl_dir, tiny_hf_vl_model

pytestmark = pytest.mark.browser

KEY = "ui-test-key"
WAIT_S = 30


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One engine behind two apps: an open one and one that needs the API key. The context is long enough
    for an answer that is still streaming when the test presses Stop."""
    path = save_hf_dir(tiny_hf_model(seed=61, max_position_embeddings=4096), str(tmp_path_factory.mktemp("ui")))
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_memory="8MiB")))
    with live_server(build_app(engine, ["tiny", "tiny-b"])) as open_url, \
            live_server(build_app(engine, ["tiny"], api_key=KEY)) as keyed_url:
        yield open_url, keyed_url
    engine.shutdown()


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    """A tiny random Qwen2-VL: a model that reads images."""
    path = save_hf_vl_dir(tiny_hf_vl_model("qwen2_vl", seed=5), str(tmp_path_factory.mktemp("ui-vl")))
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_memory="8MiB")))
    with live_server(build_app(engine, ["tiny-vl"])) as url:
        yield url
    engine.shutdown()


@pytest.fixture(scope="module")
def driver():
    missing = [exe for exe in ("chromium", "chromedriver") if shutil.which(exe) is None]
    if missing:  # fail, not skip: CI must run these tests
        pytest.fail(f"{' and '.join(missing)} not found: the web UI tests need Debian's chromium and chromium-driver "
                    "(bash scripts/ensure_browser.sh, run by the set-up, installs them)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is not installed: it comes with the `test` extra (scripts/ensure_venv.sh installs it)")

    options = webdriver.ChromeOptions()
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, for screenshot()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--disable-extensions"):
        options.add_argument(arg)
    # the system chromedriver, by path: Selenium Manager would try to download one (no internet here)
    d = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    path = Path(os.environ.get("QWENSERVE_SCREENSHOTS") or tmp_path_factory.mktemp("web_ui_screenshots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def screenshot(driver, shots: Path, name: str, capsys) -> None:
    """Saves the page as shots/name.png, prints where, and checks that the page has thrown no JavaScript error and
    broken no rule of its Content-Security-Policy since the last call (the console's network lines, such as an
    expected 401, are not errors of the page)."""
    path = shots / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"could not save {path}"
    with capsys.disabled():  # shown in the test output even when pytest captures it
        print(f"\n[web UI screenshot] {path}")
    errors = [e["message"] for e in driver.get_log("browser")
              if e["source"] == "javascript" or "Content Security Policy" in e["message"]]
    assert not errors, errors


def wait(driver, condition, what: str, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), what)


def by_css(driver, selector):
    from selenium.webdriver.common.by import By
    return driver.find_elements(By.CSS_SELECTOR, selector)


def open_page(driver, url: str) -> None:
    """A fresh page, with nothing stored by an earlier one."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url + "/")


def fill(driver, field_id: str, value) -> None:
    el = by_css(driver, f"#{field_id}")[0]
    el.clear()
    el.send_keys(str(value))


def model_options(driver) -> list[str]:
    return [o.get_attribute("value") for o in by_css(driver, "#model option")]


def send_message(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys
    by_css(driver, "#prompt")[0].send_keys(text, Keys.ENTER)


def metric(url: str, name: str, **labels: str) -> float:
    return metric_value(httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text, name, **labels)


def test_chat_streams_the_answer_with_ttft_and_speed(servers, driver, shots, capsys):
    url = servers[0]
    open_page(driver, url)
    wait(driver, lambda d: model_options(d) == ["tiny", "tiny-b"], "the model list from /v1/models")
    fill(driver, "system", "You answer briefly.")
    fill(driver, "temperature", 0)
    fill(driver, "max-tokens", 150)
    by_css(driver, "#ignore-eos")[0].click()
    # record the length of the answer's text the page shows at every change it makes to the page, and count the
    # renders and the animation frames
    driver.execute_script("""
        window.renders = 0;
        window.frames = 0;
        const render = window.renderMarkdownInto;
        window.renderMarkdownInto = (el, text) => { window.renders++; render(el, text); };
        const tick = () => { window.frames++; requestAnimationFrame(tick); };
        requestAnimationFrame(tick);
        window.lengths = [];
        new MutationObserver(() => {
          const el = document.querySelector('.msg.assistant .content');
          if (el) window.lengths.push(el.markdownSource?.length ?? 0);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    send_message(driver, "hello there")
    wait(driver, lambda d: by_css(d, ".msg.assistant .stats"), "the answer's stats line")
    stats = by_css(driver, ".msg.assistant .stats")[0].text
    answer, rendered_as_whole, only_blocks = driver.execute_script("""
        const el = document.querySelector('.msg.assistant .content');
        const whole = document.createElement('div');
        renderMarkdownInto(whole, el.markdownSource);
        return [el.markdownSource, el.innerHTML === whole.innerHTML,
                el.childNodes.length > 0 && [...el.childNodes].every((n) => n.nodeType === Node.ELEMENT_NODE)];""")
    lengths, renders, frames = driver.execute_script("return [window.lengths, window.renders - 1, window.frames]")
    chunks = int(by_css(driver, ".msg.assistant")[0].get_attribute("data-chunks"))
    screenshot(driver, shots, "chat_streamed", capsys)

    assert "TTFT" in stats and "tok/s" in stats and "150 tokens" in stats and "finish: length" in stats, stats
    assert "– tok/s" not in stats
    growing = [n for n in lengths if n > 0]
    assert chunks > 1 and len(set(growing)) >= 3 and growing == sorted(growing), (chunks, lengths)
    # at most one render per animation frame, however fast the tokens came (and one more for the whole answer)
    assert 3 <= renders <= frames + 1, (renders, frames, chunks)
    # rendered as Markdown (every piece of text inside a block element), and the blocks kept from the renders made
    # while it streamed are those a render of the whole answer makes
    assert only_blocks and rendered_as_whole
    # the page put the streamed pieces together right, and sent the system prompt and the settings
    full = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 150, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "hello there"}],
    }).json()["choices"][0]["message"]["content"]
    assert answer == full


def test_stop_aborts_the_request_and_metrics_count_it(servers, driver, shots, capsys):
    url = servers[0]
    open_page(driver, url)
    wait(driver, lambda d: model_options(d), "the model list")
    aborted = metric(url, "vllm:request_success_total", finished_reason="abort")
    fill(driver, "max-tokens", 3800)  # far more than the time it takes to press Stop
    by_css(driver, "#ignore-eos")[0].click()
    send_message(driver, "tell me a long story")
    wait(driver, lambda d: int(d.execute_script(
        "return document.querySelector('.msg.assistant')?.dataset.chunks || 0")) >= 3, "the answer streaming")
    # The button is pressed from the page's own script: chromedriver 150's click() returned only once the stream had
    # ended (11.8 s at ~320 tokens/s on the tiny model), too late to stop anything.
    stop = by_css(driver, "#stop")[0]
    assert not stop.get_attribute("disabled")
    driver.execute_script("arguments[0].click()", stop)
    wait(driver, lambda d: by_css(d, ".msg.assistant .stats"), "the stopped answer's stats")
    stats = by_css(driver, ".msg.assistant .stats")[0].text
    assert "finish: stopped" in stats and "TTFT" in stats, stats
    assert not by_css(driver, "#send")[0].get_attribute("disabled")
    deadline = time.time() + 10
    while metric(url, "vllm:request_success_total", finished_reason="abort") <= aborted and time.time() < deadline:
        time.sleep(0.1)
    screenshot(driver, shots, "chat_stopped", capsys)
    assert metric(url, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(url, "vllm:num_requests_running") == 0


def _traffic(url: str, seconds: float) -> None:
    """Requests sharing a long prefix (so the prefix cache hits), from four clients at once."""
    prefix = "You are a careful assistant who answers questions about the weather in many cities. " * 2
    end = time.time() + seconds

    def client(k: int):
        with httpx.Client(timeout=60) as c:
            i = 0
            while time.time() < end:
                c.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": f"city {k} {i}"}],
                    "max_tokens": 40, "ignore_eos": True, "temperature": 0})
                i += 1
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_dashboard_draws_live_charts(servers, driver, shots, capsys):
    url = servers[0]
    open_page(driver, url)
    driver.get(url + "/#dashboard")
    wait(driver, lambda d: "updated" in by_css(d, "#dash-status")[0].text, "the first /metrics poll")
    traffic = threading.Thread(target=_traffic, args=(url, 4.0))
    traffic.start()
    canvases = [c.get_attribute("id") for c in by_css(driver, "canvas")]
    assert len(canvases) == 6
    try:
        wait(driver, lambda d: all(int(c.get_attribute("data-points") or 0) >= 2 for c in by_css(d, "canvas")),
             "points on every chart")
    finally:
        traffic.join()
    # one more poll after the traffic, so the charts show it whole: the first change of the status may come from a
    # poll that was under way while the traffic ended; the next poll starts only after it
    for _ in range(2):
        status = by_css(driver, "#dash-status")[0].text  # "updated <time>", polls at least 1 s apart
        wait(driver, lambda d: by_css(d, "#dash-status")[0].text != status, "the next /metrics poll")
    screenshot(driver, shots, "dashboard", capsys)
    # a line was drawn in colour on every chart (the grid and labels are grey)
    coloured = driver.execute_script("""
        return [...document.querySelectorAll('canvas')].map((c) => {
          const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < px.length; i += 4) {
            const rgb = [px[i], px[i + 1], px[i + 2]];
            if (px[i + 3] > 0 && Math.max(...rgb) - Math.min(...rgb) > 80) n++;
          }
          return n;
        });""")
    assert all(n > 20 for n in coloured), dict(zip(canvases, coloured))
    legends = {c: by_css(driver, f"#{c} + .legend")[0].text for c in canvases}
    assert "p99" in legends["chart-ttft"] and "p50" in legends["chart-tpot"], legends
    # generated tokens per second, from the counters; the shared prefix found in the cache
    assert float(re.search(r"generated ([\d.]+)", legends["chart-tokens"])[1]) > 0, legends
    assert float(re.search(r"hit rate ([\d.]+)", legends["chart-prefix"])[1]) > 0, legends


def test_dashboard_sums_replicas_and_reads_histograms(servers, driver):
    """The page's own parser on exposition text with an `engine` label (data-parallel replicas): counts add up,
    fractions average, ratios divide the sums, and percentiles follow Prometheus's histogram_quantile."""
    open_page(driver, servers[0])
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="tiny"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5',
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.25',
        'vllm:prefix_cache_hits_total{engine="0"} 1.0', 'vllm:prefix_cache_hits_total{engine="1"} 2.0',
        'vllm:prefix_cache_queries_total{engine="0"} 4.0', 'vllm:prefix_cache_queries_total{engine="1"} 8.0',
        'h_bucket{le="0.1",engine="0"} 1.0', 'h_bucket{le="0.5",engine="0"} 3.0',
        'h_bucket{le="1.0",engine="0"} 4.0', 'h_bucket{le="+Inf",engine="0"} 5.0',
        'h_bucket{le="0.1",engine="1"} 1.0', 'h_bucket{le="0.5",engine="1"} 3.0',
        'h_bucket{le="1.0",engine="1"} 4.0', 'h_bucket{le="+Inf",engine="1"} 5.0',
    ])
    got = driver.execute_script("""
        const m = parseMetrics(arguments[0]);
        const b = buckets(m, 'h');
        return [sum(m, 'vllm:num_requests_running'), mean(m, 'vllm:kv_cache_usage_perc'),
                quantile(0.5, b), quantile(0.9, b), sum(m, 'absent'),
                ratio(m, 'vllm:prefix_cache_hits_total', 'vllm:prefix_cache_queries_total')];""", text)
    assert got[:2] == [5, 0.375] and got[4] is None and got[5] == 0.25
    assert got[2] == pytest.approx(0.4) and got[3] == pytest.approx(1.0)  # 0.1 + 0.4 * 3/4; past 1.0: its bound


def test_api_key_asked_for_then_used(servers, driver, shots, capsys):
    url = servers[1]
    # the page itself is open; the API is not
    assert httpx.get(url + "/").status_code == 200 and httpx.get(url + "/ui/app.js").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    open_page(driver, url)
    wait(driver, lambda d: d.find_element("id", "notice").is_displayed(), "the notice asking for the key")
    assert "API key" in by_css(driver, "#notice")[0].text and model_options(driver) == []
    send_message(driver, "hi")
    wait(driver, lambda d: by_css(d, ".msg.assistant.error"), "the 401 shown in the chat")
    assert "API key" in by_css(driver, ".msg.assistant.error")[0].text
    screenshot(driver, shots, "api_key_needed", capsys)

    fill(driver, "api-key", KEY)
    by_css(driver, "#save-key")[0].click()
    wait(driver, lambda d: model_options(d) == ["tiny"], "the model list, with the key")
    assert not driver.find_element("id", "notice").is_displayed()
    # the key lives in the tab's memory only: a script that got into the page finds it in no storage
    assert stored_keys(driver) == [None, None]
    # greedy and past EOS: a sampled answer can end at its first token, with no text and so no stats
    fill(driver, "temperature", 0)
    fill(driver, "max-tokens", 20)
    by_css(driver, "#ignore-eos")[0].click()
    send_message(driver, "hi again")
    wait(driver, lambda d: len(by_css(d, ".msg.assistant .stats")) == 1, "an answer, with the key")
    assert by_css(driver, ".msg.assistant:not(.error) .content")[0].text
    by_css(driver, "#tab-dashboard")[0].click()  # the dashboard's /metrics calls carry the key too
    wait(driver, lambda d: "updated" in by_css(d, "#dash-status")[0].text, "a /metrics poll with the key")
    screenshot(driver, shots, "api_key_entered", capsys)


def stored_keys(driver) -> list:
    return driver.execute_script("return [localStorage.getItem('qwenserve.apiKey'), "
                                 "sessionStorage.getItem('qwenserve.apiKey')]")


def test_api_key_is_kept_for_the_tab_only_when_asked_and_never_in_local_storage(servers, driver):
    url = servers[1]
    open_page(driver, url)
    fill(driver, "api-key", KEY)
    by_css(driver, "#save-key")[0].click()
    wait(driver, lambda d: model_options(d) == ["tiny"], "the model list, with the key")
    driver.refresh()  # not kept: a reload forgets it
    wait(driver, lambda d: d.find_element("id", "notice").is_displayed(), "the notice asking for the key again")
    assert by_css(driver, "#api-key")[0].get_attribute("value") == "" and stored_keys(driver) == [None, None]

    fill(driver, "api-key", KEY)
    by_css(driver, "#keep-key")[0].click()
    by_css(driver, "#save-key")[0].click()
    wait(driver, lambda d: model_options(d) == ["tiny"], "the model list, with the key")
    assert stored_keys(driver) == [None, KEY]
    driver.refresh()  # kept for the tab: sessionStorage
    wait(driver, lambda d: model_options(d) == ["tiny"], "the model list, with the kept key")
    assert by_css(driver, "#keep-key")[0].is_selected() and stored_keys(driver) == [None, KEY]

    by_css(driver, "#keep-key")[0].click()  # unticked and saved again: forgotten by the tab's storage
    by_css(driver, "#save-key")[0].click()
    wait(driver, lambda d: stored_keys(d) == [None, None], "the kept key removed")

    # a key an older version left in localStorage is removed when the page loads
    driver.execute_script("localStorage.setItem('qwenserve.apiKey', arguments[0])", KEY)
    driver.refresh()
    wait(driver, lambda d: d.find_element("id", "notice").is_displayed(), "the notice asking for the key")
    assert stored_keys(driver) == [None, None]


# ---------------------------------------------------------------- answers rendered as Markdown

LINK = 'target="_blank" rel="noopener noreferrer"'
CODE_HEAD = ('<div class="code-head"><span class="code-lang">{}</span><button type="button" class="copy-code">Copy'
             "</button></div>")
MARKDOWN_CASES = {  # {url}: the page's own origin (a relative link is written back as the URL it resolves to)
    "Hi *em*, **strong**, ***both***, `a < b`, ~~gone~~ and snake_case_name":
        "<p>Hi <em>em</em>, <strong>strong</strong>, <em><strong>both</strong></em>, <code>a &lt; b</code>, "
        "<s>gone</s> and snake_case_name</p>",
    "**a *b* c** and *a **b** c* and \\*not\\*":
        "<p><strong>a <em>b</em> c</strong> and <em>a <strong>b</strong> c</em> and *not*</p>",
    "# Title #\n### Sub\none\ntwo\n\n---\n> quoted":
        "<h1>Title</h1><h3>Sub</h3><p>one<br>\ntwo</p><hr><blockquote><p>quoted</p></blockquote>",
    "- a\n- b\n  1. c\n  2. d\n- e":
        "<ul><li>a</li><li>b\n<ol><li>c</li><li>d</li></ol></li><li>e</li></ul>",
    "3. three\n\n4. four": '<ol start="3"><li><p>three</p></li><li><p>four</p></li></ol>',
    "[docs](https://example.com/a?b=1&c=2 \"Docs\") and https://example.com/x.":
        f'<p><a href="https://example.com/a?b=1&amp;c=2" title="Docs" {LINK}>docs</a> and '
        f'<a href="https://example.com/x" {LINK}>https://example.com/x</a>.</p>',
    "[rel](/v1/models) [frag](#x) <mailto:a@b.c> ![alt *text*](/p.png \"T\") example.com":
        f'<p><a href="{{url}}/v1/models" {LINK}>rel</a> <a href="{{url}}/#x" {LINK}>frag</a> '
        f'<a href="mailto:a@b.c" {LINK}>mailto:a@b.c</a> <a href="{{url}}/p.png" title="T" {LINK}>alt text</a> '
        "example.com</p>",
    # a bare URL with a user name or password stays text (linkify-it would link only http://user)
    "http://user:pass@e.x/ and https://good.example@evil.example/ but https://a.example: and http://a.example:80/x":
        f"<p>http://user:pass@e.x/ and https://good.example@evil.example/ but <a href=\"https://a.example/\" {LINK}>"
        f'https://a.example</a>: and <a href="http://a.example/x" {LINK}>http://a.example:80/x</a></p>',
    "| a | b |\n|:--|--:|\n| 1 | **2** |":
        '<div class="table-wrap"><table><thead><tr><th class="align-left">a</th><th class="align-right">b</th>'
        '</tr></thead><tbody><tr><td class="align-left">1</td><td class="align-right"><strong>2</strong></td></tr>'
        "</tbody></table></div>",
    "```python\nif a < b:\n    print('*x*')\n```\nafter":
        f'<div class="code-block">{CODE_HEAD.format("python")}<pre><code class="language-python">if a &lt; b:\n'
        "    print('*x*')</code></pre></div><p>after</p>",
    "```\nstill streaming":
        f'<div class="code-block">{CODE_HEAD.format("")}<pre><code>still streaming</code></pre></div>',
}


def test_markdown_renderer_cases(servers, driver):
    """render.js in the page, on given texts: each case's HTML exactly."""
    open_page(driver, servers[0])
    got = driver.execute_script("return arguments[0].map((t) => renderMarkdown(t))", list(MARKDOWN_CASES))
    assert dict(zip(MARKDOWN_CASES, got)) == {k: v.replace("{url}", servers[0]) for k, v in MARKDOWN_CASES.items()}


def test_markdown_rerender_keeps_the_unchanged_blocks(servers, driver):
    """While an answer streams, a render replaces only the blocks that changed: the earlier ones stay the same
    elements (no flicker, a selection or a hovered Copy button in them survives)."""
    open_page(driver, servers[0])
    streaming = "# Title\n\nfirst paragraph\n\n```js\nlet a"
    whole = "# Title\n\nfirst paragraph\n\n```js\nlet a = 1;\n```\n\n- x"
    kept, replaced, html = driver.execute_script("""
        const el = document.createElement('div');
        renderMarkdownInto(el, arguments[0]);
        const before = [...el.children];
        renderMarkdownInto(el, arguments[1]);
        const after = [...el.children];
        return [before.map((node, k) => node === after[k]), after.length,
                el.innerHTML === renderMarkdown(arguments[1])];""",
        streaming, whole)
    assert kept == [True, True, False] and replaced == 4 and html


def test_markdown_escapes_html_and_refuses_unsafe_links(servers, driver, shots, capsys):
    """The model's text is untrusted: raw HTML shows as text and runs nothing; javascript: and data: links are
    not links (they show as the text they are); an image is a link to it, never fetched."""
    open_page(driver, servers[0])
    evil = ('<img src=x onerror="window.pwned=1"> and <script>window.pwned=2</script> <b>bold?</b>\n\n'
            "[one](javascript:window.pwned=3) [two](JavaScript:alert(1)) [three](data:text/html,hi) "
            '![pic](https://example.com/p.png) <svg onload="window.pwned=4">\n\n'
            '```html\n<img src=y onerror="window.pwned=5">\n```\n\n`<iframe src="javascript:alert(1)">`')
    found = driver.execute_script("""
        const bubble = document.createElement('div');
        bubble.className = 'msg assistant';
        const el = document.createElement('div');
        el.className = 'content markdown';
        bubble.append(el);
        document.getElementById('messages').append(bubble);
        renderMarkdownInto(el, arguments[0]);
        return {tags: [...el.querySelectorAll('img, script, svg, iframe, b')].map((e) => e.tagName),
                hrefs: [...el.querySelectorAll('a')].map((a) => a.getAttribute('href')),
                text: el.textContent};""", evil)
    time.sleep(0.3)  # an onerror or onload handler would have run by now
    screenshot(driver, shots, "markdown_escaped", capsys)
    assert driver.execute_script("return window.pwned") is None
    assert found["tags"] == [] and found["hrefs"] == ["https://example.com/p.png"], found
    for raw in ('<img src=x onerror="window.pwned=1">', "<script>window.pwned=2</script>", "<b>bold?</b>",
                '<svg onload="window.pwned=4">', '<img src=y onerror="window.pwned=5">',
                '<iframe src="javascript:alert(1)">'):
        assert raw in found["text"]
    assert "[one](javascript:window.pwned=3) [two](JavaScript:alert(1)) [three](data:text/html,hi) pic" in found["text"]


def test_what_comes_from_the_network_is_shown_as_text(servers, driver, shots, capsys):
    """Model names, an answer's reasoning and tool-call arguments, an image's alt text and error messages come from
    the network: with hostile markup in each (the server's responses stood in for by the page's fetch), the page
    shows it as text, makes no element of it and runs nothing."""
    open_page(driver, servers[0])
    # the page's own model list first: its fetch, answered after the stand-in's, would overwrite that one
    wait(driver, lambda d: model_options(d), "the page's own model list")
    evil = f"<img src=x onerror=\"{SENTINEL}('net')\"><b>x</b>"
    chunks = [{"choices": [{"index": 0, "delta": {"reasoning_content": evil}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "id": "c", "type": "function", "function": {"name": evil, "arguments": ""}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": evil}}]}}]},
              {"choices": [{"index": 0, "delta": {"content": f"![{evil}](https://example.com/p.png)"}}]},
              {"error": {"message": evil}}]
    driver.execute_script(RENDER_CHECK_JS + f"""
        window.pwned = [];
        window.{SENTINEL} = (name) => window.pwned.push(name);
        const sse = arguments[0].map((c) => 'data: ' + JSON.stringify(c) + '\\n\\n').join('');
        window.fetch = async (path) => String(path).endsWith('/v1/models')
          ? new Response(JSON.stringify({{data: [{{id: arguments[1]}}]}}))
          : new Response(sse, {{headers: {{'Content-Type': 'text/event-stream'}}}});
        loadModels();""", chunks, evil)
    wait(driver, lambda d: model_options(d) == [evil], "the model list, from the stand-in")
    send_message(driver, "hi")
    wait(driver, lambda d: by_css(d, ".msg.assistant.error"), "the error, from the stand-in")
    time.sleep(0.3)  # a handler that was queued would have run by now
    shown = driver.execute_script("""
        const bubble = document.querySelector('.msg.assistant');
        const text = (sel) => bubble.querySelector(sel)?.textContent;
        return {findings: renderCheck.audit(bubble.querySelector('.content')),
                tags: [...document.querySelectorAll('#model *, .msg.assistant details *')].map((e) => e.tagName),
                model: document.querySelector('#model option').textContent, reasoning: text('.reasoning .side-text'),
                calls: text('.tool-calls .side-text'), link: text('.content a'), error: text('.content p:last-child'),
                pwned: window.pwned};""")
    screenshot(driver, shots, "network_text", capsys)
    assert shown["findings"] == [] and shown["pwned"] == []
    assert sorted(set(shown["tags"])) == ["DIV", "OPTION", "SUMMARY"]  # the page's own: no element from the text
    assert shown["model"] == evil and shown["reasoning"] == evil and shown["calls"] == f"{evil}({evil})"
    assert shown["link"] == evil and shown["error"] == f"[error: {evil}]"  # the alt text, as text


RENDER_CHECK_JS = (Path(__file__).parent / "render_check.js").read_text()
EVERY_PREFIX_UP_TO = 600  # characters: a longer answer is cut at PREFIXES points instead
PREFIXES = 8


def test_hostile_answers_render_inside_the_allowlist_and_in_time(servers, driver, shots, capsys):
    """hostile_markdown.py's corpus through the page's renderer, under the server's CSP: each answer rendered
    prefix by prefix into one element (as it streams in) and then whole, the DOM audited after every render
    (render_check.js). Nothing runs or is blocked trying, nothing is fetched, no element, attribute or link target
    is off the allowlist, no render throws or takes 1 s."""
    url = servers[0]
    open_page(driver, url)
    driver.execute_script(RENDER_CHECK_JS + f"""
        window.pwned = [];
        window.{SENTINEL} = (name) => window.pwned.push(name);
        window.violations = [];
        document.addEventListener('securitypolicyviolation', (e) => window.violations.push(e.violatedDirective));""")
    items = corpus()
    # however deep the nesting, the innermost text ("x") still shows: nothing past a depth cap is dropped
    options = {"everyPrefixUpTo": EVERY_PREFIX_UP_TO, "prefixes": PREFIXES,
               "mustShow": {name: "x" for name, _ in items if name.startswith("nest ")}}
    driver.set_script_timeout(300)
    reports = [driver.execute_script("return renderCheck.renderCorpus(arguments[0], arguments[1])", items[k:k + 40],
                                     options) for k in range(0, len(items), 40)]
    time.sleep(0.5)  # a handler that was queued would have run by now
    pwned, violations, foreign = driver.execute_script(
        "return [window.pwned, window.violations, performance.getEntriesByType('resource').map((r) => r.name)"
        ".filter((n) => !n.startsWith(location.origin + '/'))]")
    renders = sum(r["renders"] for r in reports)
    slowest = max((r["slowest"] for r in reports), key=lambda s: s[0])
    whole = sorted(((ms, name) for r in reports for name, ms in r["wholeMs"].items()), reverse=True)
    with capsys.disabled():
        print(f"\n[hostile corpus] {len(items)} answers, {renders} renders; slowest {slowest[0]:.0f} ms "
              f"({slowest[1]} at {slowest[2]} characters); slowest whole: "
              + ", ".join(f"{name} {ms:.0f} ms" for ms, name in whole[:3]))
    screenshot(driver, shots, "hostile_corpus", capsys)
    assert pwned == [] and violations == [] and foreign == [], (pwned, violations, foreign)
    assert [e for r in reports for e in r["errors"]] == []
    assert [f for r in reports for f in r["findings"]] == []
    assert renders >= len(items) * 2 and slowest[0] < 1000, slowest


def test_ui_responses_carry_the_security_headers(servers):
    """The page, every file under /ui/ (the vendored libraries too) and a missing one, with and without an API
    key: the CSP that lets the page run only the server's own files, nosniff, no referrer, no DNS prefetch. The
    API's JSON does not need them."""
    from qwenserve.entrypoints.openai.api_server import UI_PATHS
    assert "/ui/vendor/markdown-it.min.js" in UI_PATHS and "/ui/vendor/purify.min.js" in UI_PATHS
    for url, missing in zip(servers, (404, 401)):  # the keyed server opens only the files it has
        for path in sorted(UI_PATHS) + ["/ui/missing.js"]:
            resp = httpx.get(url + path)
            assert resp.status_code == (missing if path == "/ui/missing.js" else 200), path
            csp = {d.split(" ", 1)[0]: d.split(" ", 1)[1] for d in resp.headers["content-security-policy"].split("; ")}
            assert csp == {"default-src": "'self'", "script-src": "'self'", "img-src": "'self' data: blob:",
                           "object-src": "'none'", "base-uri": "'none'", "frame-ancestors": "'none'",
                           "form-action": "'self'"}, path
            assert resp.headers["x-content-type-options"] == "nosniff", path
            assert resp.headers["referrer-policy"] == "no-referrer", path
            assert resp.headers["x-dns-prefetch-control"] == "off", path  # no lookup of a link's host
        assert "content-security-policy" not in httpx.get(url + "/health").headers


def test_code_block_copy_button_puts_the_code_on_the_clipboard(servers, driver, shots, capsys):
    url = servers[0]
    driver.execute_cdp_cmd("Browser.grantPermissions", {"origin": url, "permissions": [
        "clipboardReadWrite", "clipboardSanitizedWrite"]})
    open_page(driver, url)
    codes = ["def f(x):\n    return x < 1 and '&'\n\n\tindented", "echo second <block>"]
    driver.execute_script("""
        const bubble = document.createElement('div');
        bubble.className = 'msg assistant';
        const el = document.createElement('div');
        el.className = 'content markdown';
        bubble.append(el);
        document.getElementById('messages').append(bubble);
        renderMarkdownInto(el, 'Two blocks:\\n\\n```python\\n' + arguments[0] + '\\n```\\n\\n~~~sh\\n' + arguments[1]
                               + '\\n~~~\\n');
        window.realClipboard = navigator.clipboard;""", *codes)
    shown = driver.execute_script("return [...document.querySelectorAll('.code-block code')].map((c) => c.textContent)")
    assert shown == codes
    read_clipboard = "const done = arguments[0]; window.realClipboard.readText().then(done, (e) => done('ERR ' + e));"
    buttons = by_css(driver, ".code-block .copy-code")
    assert len(buttons) == 2
    buttons[0].click()
    wait(driver, lambda d: buttons[0].text == "Copied", "the first button saying Copied")
    assert driver.execute_async_script(read_clipboard) == codes[0]
    screenshot(driver, shots, "code_copied", capsys)
    # without navigator.clipboard (plain http from another machine): the fallback copies
    driver.execute_script("Object.defineProperty(navigator, 'clipboard', {value: undefined, configurable: true})")
    buttons[1].click()
    wait(driver, lambda d: buttons[1].text == "Copied", "the second button saying Copied")
    assert driver.execute_async_script(read_clipboard) == codes[1]


# ---------------------------------------------------------------- odd input from the network and the keyboard

def sse(events, done: bool = True) -> str:
    """Server-sent events: each event as JSON (a string as it is), then [DONE] when `done`."""
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return body + ("data: [DONE]\n\n" if done else "")


def delta(**fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


FINISHED = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


def stand_in(driver, body: str | None = None, models=None, held: bool = False) -> None:
    """The server's responses stood in for by the page's fetch: /v1/chat/completions streams `body` (when `held`,
    only once the page's window.release() is called), /v1/models answers `models` (JSON). The bodies the page
    posts are kept in window.posted. The page's own model list is waited for first: its fetch, answered after the
    stand-in's, would overwrite that one."""
    wait(driver, lambda d: model_options(d), "the page's own model list")
    driver.execute_script("""
        window.posted = [];
        const [body, models, held] = arguments;
        window.fetch = async (path, options) => {
          if (String(path).endsWith('/v1/models')) return new Response(JSON.stringify(models));
          window.posted.push(options.body);
          const stream = new ReadableStream({start(c) {
            window.release = () => { c.enqueue(new TextEncoder().encode(body)); c.close(); };
            if (!held) window.release();
          }});
          return new Response(stream, {headers: {'Content-Type': 'text/event-stream'}});
        };""", body, models, held)


def answered(driver, text: str = "hi") -> None:
    """Sends `text` and waits for its answer to end (the Send button enabled again)."""
    send_message(driver, text)
    wait(driver, lambda d: by_css(d, ".msg.assistant") and not by_css(d, "#send")[0].get_attribute("disabled"),
         "the answer's end")


MARK = "\u0301"  # a combining acute accent: one token each in Qwen's tokenizer


def test_combining_marks_are_capped_per_character(servers, driver, shots, capsys):
    """One character followed by 20,000 combining marks takes the browser seconds to lay out (its layout of one
    cluster is quadratic): in an answer, its reasoning and its tool calls, each character keeps at most 16."""
    open_page(driver, servers[0])
    cluster = "a" + MARK * 20000
    pieces = [cluster[k:k + 500] for k in range(0, len(cluster), 500)]
    events = ([delta(reasoning_content=p) for p in pieces]
              + [delta(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": p}}]) for p in pieces]
              + [delta(content=p) for p in pieces] + [delta(content=" b" + MARK * 3), FINISHED])
    stand_in(driver, sse(events))
    start = time.time()
    answered(driver)
    seconds = time.time() - start
    marks = driver.execute_script("""
        const marks = (text) => text.split(arguments[0]).length - 1;
        const count = (sel) => marks(document.querySelector('.msg.assistant ' + sel).textContent);
        return [count('.content'), count('.reasoning .side-text'), count('.tool-calls .side-text'),
                marks(renderMarkdown('x' + arguments[0].repeat(100)))];""", MARK)
    screenshot(driver, shots, "combining_marks", capsys)
    assert marks == [16 + 3, 16, 16, 16], marks
    assert seconds < WAIT_S


def test_stacked_marks_do_not_paint_over_other_messages(servers, driver, shots, capsys):
    """Marks stacked on an answer's characters reach far above its line: its bubble clips them, so an answer
    cannot draw over the message above it (the user's, or another answer made to look like one)."""
    open_page(driver, servers[0])
    zalgo = "".join(c + "\u030d\u030e\u0304\u0305" * 4 for c in "SPOOF " * 30)
    stand_in(driver, sse([delta(content=zalgo), FINISHED]), held=True)
    send_message(driver, "a question long enough to span the width of the chat, as wide as the answer below it " * 2)
    wait(driver, lambda d: by_css(d, ".msg.assistant"), "the answer's bubble")
    question = by_css(driver, ".msg.user")[0]
    before = question.screenshot_as_png
    driver.execute_script("window.release()")
    wait(driver, lambda d: not by_css(d, "#send")[0].get_attribute("disabled"), "the answer's end")
    assert driver.execute_script("return document.getElementById('messages').scrollTop") == 0  # nothing moved
    after = question.screenshot_as_png
    screenshot(driver, shots, "stacked_marks", capsys)
    assert after == before, "the answer's marks were drawn over the question"


def test_frame_throttle_counts_the_layout_a_draw_causes(servers, driver):
    """A draw that is quick itself but makes the page's layout slow (a long cluster of combining marks) is
    throttled by its whole cost: while values stream in for 3 s, drawing and laying out take a fraction of the
    time, not all of it."""
    open_page(driver, servers[0])
    driver.set_script_timeout(60)
    busy, elapsed, draws = driver.execute_async_script("""
        const done = arguments[0];
        const bubble = document.createElement('div');
        bubble.className = 'msg assistant';
        const box = document.createElement('div');
        bubble.append(box);
        document.getElementById('messages').append(bubble);
        let busy = 0, draws = 0;
        const scroll = bubble.scrollIntoView;
        bubble.scrollIntoView = (options) => {  // the layout is forced here
          const t = performance.now();
          scroll.call(bubble, options);
          busy += performance.now() - t;
        };
        const view = frameThrottled(bubble, (n) => {
          const t = performance.now();
          box.textContent = 'a' + '\\u0301'.repeat(n);
          draws++;
          busy += performance.now() - t;
        });
        const start = performance.now();
        let n = 8000;
        const timer = setInterval(() => {
          view.update(n++);
          if (performance.now() - start > 3000) {
            clearInterval(timer);
            view.cancel();
            done([busy, performance.now() - start, draws]);
          }
        }, 2);""")
    assert draws >= 2 and busy / elapsed < 0.5, (busy, elapsed, draws)


def test_enter_that_ends_a_composition_does_not_send(servers, driver):
    """Chinese, Japanese or Korean input: the Enter that confirms the input method's composition (isComposing,
    keyCode 229) ends it; only a later Enter sends."""
    open_page(driver, servers[0])
    stand_in(driver, sse([delta(content="ok"), FINISHED]))
    driver.execute_script("""
        const prompt = document.getElementById('prompt');
        prompt.value = 'ni hao';
        for (const init of [{isComposing: true, keyCode: 229}, {isComposing: false, keyCode: 229},
                            {isComposing: true, keyCode: 13}]) {
          prompt.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true, cancelable: true, ...init}));
        }""")
    time.sleep(0.5)
    assert driver.execute_script("return window.posted.length") == 0 and not by_css(driver, ".msg")
    assert by_css(driver, "#prompt")[0].get_attribute("value") == "ni hao"
    answered(driver, "")  # a plain Enter
    assert [json.loads(b)["messages"][-1]["content"] for b in driver.execute_script("return window.posted")] == [
        "ni hao"]


def test_a_stream_that_ends_without_done_is_marked_cut_short(servers, driver, shots, capsys):
    """A body that just ends (a proxy's timeout, a restarted server) before [DONE] is not shown as a whole
    answer."""
    open_page(driver, servers[0])
    stand_in(driver, sse([delta(content="The answer is "), delta(content="that you should never")], done=False))
    answered(driver)
    bubble = by_css(driver, ".msg.assistant")[0]
    screenshot(driver, shots, "stream_cut_short", capsys)
    assert "error" in bubble.get_attribute("class").split()
    assert by_css(driver, ".msg.assistant .content")[0].text == (
        "The answer is that you should never\n[connection closed before the answer finished]")
    by_css(driver, "#clear")[0].click()
    stand_in(driver, sse([delta(content="whole"), FINISHED]))  # with [DONE]: as it was
    answered(driver)
    assert by_css(driver, ".msg.assistant")[0].get_attribute("class") == "msg assistant"
    assert by_css(driver, ".msg.assistant .content")[0].text == "whole"


def test_malformed_responses_are_named_not_thrown(servers, driver, shots, capsys):
    """Valid JSON of the wrong shape from the server (a null tool call, a null event, an error that is a string,
    a model list without its data array or with null entries) neither breaks the answer nor throws: the rest is
    shown, and the notice or the answer says what was wrong."""
    open_page(driver, servers[0])
    notice = lambda d: by_css(d, "#notice")[0].text if d.find_element("id", "notice").is_displayed() else ""
    stand_in(driver, sse([delta(tool_calls=[None]), delta(content="after a null call")]))
    answered(driver)
    assert by_css(driver, ".msg.assistant .content p")[0].text == "after a null call"
    assert "a tool call that is not an object" in notice(driver), notice(driver)
    stand_in(driver, sse(["null", delta(content="after a null event")]))
    answered(driver)
    assert by_css(driver, ".msg.assistant .content p")[-1].text == "after a null event"
    assert "an event that is not an object; it is left out: null" in notice(driver), notice(driver)
    stand_in(driver, sse([delta(content="partial"), {"error": "the engine <b>failed</b>"}]))
    answered(driver)
    assert by_css(driver, ".msg.assistant.error .content p")[-1].text == "[error: the engine <b>failed</b>]"
    screenshot(driver, shots, "malformed_stream", capsys)

    for body, message in [({}, "no list of models"), ({"data": None}, "no list of models"),
                          ({"data": [None, {"id": "tiny"}, {"id": {"x": 1}}]}, "2 of the server's 3 entries")]:
        stand_in(driver, None, body)
        driver.execute_script("loadModels()")
        wait(driver, lambda d: message in notice(d), f"the notice saying {message}")
    assert model_options(driver) == ["tiny"]
    screenshot(driver, shots, "malformed_models", capsys)  # no uncaught error or rejection


def test_a_long_notice_keeps_the_page_width(servers, driver, shots, capsys):
    """An error message with no break in it (a model id, a URL) wraps inside the notice, which scrolls past 30%
    of the window's height: the page never gets wider than the window."""
    open_page(driver, servers[0])
    driver.execute_script("showNotice('GET /v1/models: ' + 'x'.repeat(20000))")
    width, window_width, height, window_height = driver.execute_script("""
        const notice = document.getElementById('notice');
        return [document.documentElement.scrollWidth, window.innerWidth, notice.getBoundingClientRect().height,
                window.innerHeight];""")
    screenshot(driver, shots, "long_notice", capsys)
    assert width <= window_width and height <= 0.3 * window_height + 1, (width, window_width, height)


# ---------------------------------------------------------------- images

def png_file(directory: Path, seed: int) -> Path:
    path = directory / f"picture-{seed}.png"
    random_image(56, 84, seed).save(path)
    return path


def pixels(data_url: str):
    import numpy as np
    from PIL import Image
    head, payload = data_url.split(",", 1)
    assert head == "data:image/png;base64", head
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB"))


def test_text_model_offers_no_image_attach(servers, driver):
    open_page(driver, servers[0])
    wait(driver, lambda d: model_options(d) == ["tiny", "tiny-b"], "the model list")
    assert httpx.get(servers[0] + "/v1/models").json()["data"][0]["capabilities"] == {"vision": False}
    assert not by_css(driver, "#attach")[0].is_displayed()


def test_images_attach_by_picker_paste_and_drop_and_go_as_content_parts(vl_server, driver, shots, capsys, tmp_path):
    import numpy as np
    url = vl_server
    assert httpx.get(url + "/v1/models").json()["data"][0]["capabilities"] == {"vision": True}
    driver.execute_cdp_cmd("Browser.grantPermissions", {"origin": url, "permissions": [
        "clipboardReadWrite", "clipboardSanitizedWrite"]})
    open_page(driver, url)
    wait(driver, lambda d: model_options(d) == ["tiny-vl"] and d.find_element("id", "attach").is_displayed(),
         "the model list and the attach button")
    # the bodies the page posts, as sent (the server answers them as usual)
    driver.execute_script("""
        window.posted = [];
        const fetched = window.fetch;
        window.fetch = (resource, options) => {
          if (String(resource).endsWith('/v1/chat/completions')) window.posted.push(options.body);
          return fetched(resource, options);
        };""")
    picked, removed, pasted, dropped = (png_file(tmp_path, seed) for seed in (1, 2, 3, 4))
    by_css(driver, "#attach-input")[0].send_keys(f"{picked}\n{removed}")  # the file picker, two files
    wait(driver, lambda d: len(by_css(d, "#attachments .thumb img")) == 2, "two thumbnails")
    by_css(driver, "#attachments .thumb .remove")[1].click()
    wait(driver, lambda d: len(by_css(d, "#attachments .thumb img")) == 1, "the second one removed")

    # a paste: the PNG put on the clipboard, then Ctrl+V in the message box
    from selenium.webdriver.common.keys import Keys
    written = driver.execute_async_script("""
        const done = arguments[1];
        const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
        navigator.clipboard.write([new ClipboardItem({'image/png': new Blob([bytes], {type: 'image/png'})})])
          .then(() => done('ok'), (e) => done('ERR ' + e));""",
        base64.b64encode(pasted.read_bytes()).decode())
    assert written == "ok", written
    prompt = by_css(driver, "#prompt")[0]
    prompt.send_keys("What is in these pictures?")
    prompt.send_keys(Keys.CONTROL, "v")
    wait(driver, lambda d: len(by_css(d, "#attachments .thumb img")) == 2, "the pasted image's thumbnail")
    assert prompt.get_attribute("value") == "What is in these pictures?"
    # a drop (an event made in the page: webdriver cannot drag a file in from outside the browser)
    driver.execute_script("""
        const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
        const files = new DataTransfer();
        files.items.add(new File([bytes], 'dropped.png', {type: 'image/png'}));
        document.getElementById('chat-form').dispatchEvent(
          new DragEvent('drop', {dataTransfer: files, bubbles: true, cancelable: true}));""",
        base64.b64encode(dropped.read_bytes()).decode())
    wait(driver, lambda d: len(by_css(d, "#attachments .thumb img")) == 3, "the dropped image's thumbnail")
    screenshot(driver, shots, "images_attached", capsys)

    fill(driver, "temperature", 0)
    fill(driver, "max-tokens", 8)
    by_css(driver, "#ignore-eos")[0].click()
    prompt.send_keys(Keys.ENTER)
    wait(driver, lambda d: by_css(d, ".msg.assistant .stats"), "the answer's stats line")
    screenshot(driver, shots, "images_answered", capsys)
    assert by_css(driver, ".msg.assistant:not(.error) .content")[0].text
    assert len(by_css(driver, ".msg.user .images img")) == 3 and not by_css(driver, "#attachments .thumb")

    posted = [json.loads(body) for body in driver.execute_script("return window.posted")]
    assert len(posted) == 1
    content = posted[0]["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "What is in these pictures?"}
    assert [part["type"] for part in content[1:]] == ["image_url"] * 3
    # the picked and dropped files as they are; the pasted one as the clipboard gives it back (re-encoded: the
    # same pixels)
    assert content[1]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(picked.read_bytes()).decode()
    assert np.array_equal(pixels(content[2]["image_url"]["url"]), np.asarray(random_image(56, 84, 3)))
    assert content[3]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(dropped.read_bytes()).decode()
