"""A real Prometheus server (Debian's prometheus package; scripts/ensure_prometheus.sh installs it) scraping a live
`qwenserve serve` every second with the shipped scrape config: after N requests its query API returns N finished
requests and N time-to-first-token observations, and every query of the shipped Grafana dashboard runs and returns
data. Skipped, with the reason, where the package is not installed."""
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from qwenserve.distributed.groups import free_port

from helpers import save_hf_dir, serve_process, tiny_hf_model

yaml = pytest.importorskip("yaml")
pytestmark = pytest.mark.prometheus

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NOT_INSTALLED = "no prometheus binary: Debian's prometheus package is not installed (scripts/ensure_prometheus.sh)"
API_KEY = "scrape-key"
N = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip(NOT_INSTALLED)
    return save_hf_dir(tiny_hf_model(seed=67, max_position_embeddings=256), str(tmp_path_factory.mktemp("model")))


@pytest.fixture
def qwenserve(model_dir, tmp_path):
    """A fresh `qwenserve serve` on the tiny model (so each test counts from zero), its API key in the environment
    (Prometheus scrapes with it, as the shipped config's authorization block says); yields its base URL. The
    metrics do not depend on the C++ kernels, so they stay off and the test needs no kernel build."""
    env = os.environ | {"QWENSERVE_API_KEY": API_KEY, "QWENSERVE_CPU_KERNELS": "0"}
    with serve_process(["--model", model_dir, "--dtype", "float32", "--kv-cache-memory", "4MiB",
                        "--served-model-name", "tiny"], tmp_path / "serve.log", env) as (_, base):
        yield base


@pytest.fixture
def prometheus(qwenserve, tmp_path):
    """Prometheus on a free port, with deploy/prometheus/prometheus.yml pointed at the live server, scraping every
    second with the key file; yields the base URL of its HTTP API once it has scraped the server."""
    tmp = tmp_path / "prometheus"
    tmp.mkdir()
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"] |= {"scrape_interval": "1s", "evaluation_interval": "1s"}
    [job] = config["scrape_configs"]
    job["static_configs"][0]["targets"] = [qwenserve.removeprefix("http://")]
    (tmp / "key").write_text(API_KEY)
    job["authorization"] = {"type": "Bearer", "credentials_file": str(tmp / "key")}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(tmp / "prometheus.log", "w") as log:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()
            try:
                if httpx.get(api + "/-/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, (tmp / "prometheus.log").read_text()
            time.sleep(0.2)
        # a first scrape (with the key) before any request: rate() sees only increases after a series' first sample
        wait_for(api, 'up{job="qwenserve", service="qwenserve"}', want=1)
        yield api
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def query(api: str, expr: str) -> list[dict]:
    """The instant query's result vector; a query Prometheus rejects fails the test with its error."""
    reply = httpx.get(api + "/api/v1/query", params={"query": expr}).json()
    assert reply["status"] == "success", f"{expr}: {reply.get('error')}"
    return reply["data"]["result"]


def wait_for(api: str, expr: str, want: float | None = None, timeout: float = 60.0) -> None:
    """Poll `expr` until its first sample is `want`, or, without one, until every sample is a number (not NaN:
    what a Grafana panel draws)."""
    deadline = time.time() + timeout
    while True:
        values = [float(sample["value"][1]) for sample in query(api, expr)]
        if values and (values[0] == want if want is not None else not any(math.isnan(v) for v in values)):
            return
        assert time.time() < deadline, f"{expr} returned {values}, not {want if want is not None else 'numbers'}"
        time.sleep(0.5)


def test_prometheus_counts_the_requests_made(qwenserve, prometheus):
    with httpx.Client(base_url=qwenserve, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        for i in range(N):
            reply = client.post("/v1/completions", json={"model": "tiny", "prompt": f"request {i}", "max_tokens": 4,
                                                         "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
    wait_for(prometheus, "sum(vllm:request_success_total)", want=N)
    wait_for(prometheus, 'sum(vllm:request_success_total{finished_reason="length", model_name="tiny"})', want=N)
    wait_for(prometheus, "sum(vllm:time_to_first_token_seconds_count)", want=N)
    wait_for(prometheus, 'sum(vllm:time_to_first_token_seconds_bucket{le="+Inf"})', want=N)
    wait_for(prometheus, "sum(vllm:generation_tokens_total)", want=4 * N)


def test_every_dashboard_query_runs_and_shows_data(qwenserve, prometheus):
    """Each panel query, with Grafana's variables as Grafana fills them (every model, a rate window of a few
    scrapes), parses in Prometheus and returns numbers once requests have been served (two with one prompt, so the
    prefix cache has hits); the model variable's label_values() query finds the served model."""
    with httpx.Client(base_url=qwenserve, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json={"model": "tiny", "prompt": "the same prompt",
                                                        "max_tokens": 3}).status_code == 200
    dashboard = json.loads((DEPLOY / "grafana" / "qwenserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 11
    for expr in exprs:
        wait_for(prometheus, expr.replace("$model_name", ".*").replace("$__rate_interval", "1m"))
    [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    metric, label = variable["definition"].removeprefix("label_values(").removesuffix(")").split(", ")
    values = httpx.get(prometheus + f"/api/v1/label/{label}/values", params={"match[]": metric}).json()
    assert values["data"] == ["tiny"]


@pytest.mark.parametrize("config", sorted((DEPLOY / "prometheus").glob("*.yml")), ids=lambda p: p.name)
def test_promtool_accepts_the_shipped_configs(config):
    if PROMTOOL is None:
        pytest.skip(NOT_INSTALLED)
    check = subprocess.run([PROMTOOL, "check", "config", "--syntax-only", str(config)], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
