"""The container recipe and the compose stack, read as files (no image is built here): what the Dockerfile copies
exists and reaches the build, it installs the CPU torch the set-up script pins and qwenserve as that script does,
runs `qwenserve serve` with flags the CLI takes, as a non-root user with a health check on /health; the compose
file's services, mounts, ports and names agree with each other and with the Prometheus and Grafana configs."""
import http.server
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from qwenserve.config.server_config import ServerConfig
from qwenserve.entrypoints.cli.main import build_parser

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments) with continued lines joined."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", (ROOT / "Dockerfile").read_text())
    stages = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instruction, _, args = line.strip().partition(" ")
            if instruction.upper() == "FROM":
                stages.append([])
            stages[-1].append((instruction.upper(), args.strip()))
    return stages


def exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"{args}: use the exec form, so that qwenserve is PID 1 and gets SIGTERM"
    return yaml.safe_load(args)


def test_dockerfile_copies_files_that_exist_and_reach_the_build():
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]
    copies = [args.split() for stage in dockerfile_stages() for instruction, args in stage if instruction == "COPY"]
    sources = [s for words in copies if not words[0].startswith("--from") for s in words[:-1]]
    assert {"pyproject.toml", "setup.py", "qwenserve"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source not in ignored, f"{source} is in .dockerignore"
    assert (ROOT / "README.md").exists() and "README.md" in sources, "pyproject.toml's readme"
    assert {".venv", ".git", "build"} <= set(ignored)


def test_dockerfile_installs_the_cpu_torch_and_qwenserve_as_the_set_up_does():
    ensure_venv = (ROOT / "scripts" / "ensure_venv.sh").read_text()
    [pinned] = set(re.findall(r"torch==[\d.]+", ensure_venv))
    runs = " && ".join(args for stage in dockerfile_stages() for instruction, args in stage if instruction == "RUN")
    commands = [shlex.split(c) for c in re.split(r"&&|;", runs) if "pip install" in c]
    torch = [c for c in commands if any(w.startswith("torch") for w in c)]
    assert torch == [["pip", "install", pinned, "--index-url", CPU_INDEX]], "only the pinned CPU wheel"
    [qwenserve] = [c for c in commands if any(w.startswith(".") for w in c)]
    assert "--no-build-isolation" in qwenserve and "--no-build-isolation" in ensure_venv, "kernels built with torch"
    assert "-c" in qwenserve, "every later install constrained to the pinned torch"
    assert "bundled = [" in (ROOT / "pyproject.toml").read_text() and "[bundled]" in runs
    assert f"'{pinned.removeprefix('torch==')}+cpu'" in runs, "the build checks the installed torch is the CPU build"


def test_the_image_serves_as_run_sh_does_as_a_non_root_user_with_a_health_check():
    final = dict(dockerfile_stages()[-1])
    argv = exec_form(final["ENTRYPOINT"]) + exec_form(final["CMD"])
    assert argv[:2] == ["qwenserve", "serve"]
    assert "set -- serve" in (ROOT / "run.sh").read_text(), "./run.sh serves by default, as the image does"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert final["EXPOSE"] == str(args.port)
    assert final["USER"] not in ("root", "0")
    health = final["HEALTHCHECK"]
    assert f"http://127.0.0.1:{args.port}/health" in health and " CMD " in f" {health} "
    assert final.get("STOPSIGNAL", "SIGTERM") == "SIGTERM"
    cache = re.search(r"QWENSERVE_CACHE=(\S+)", final["ENV"]).group(1)
    assert cache in " ".join(v for k, v in dockerfile_stages()[-1] if k == "RUN"), "made, for the user to write"


@pytest.mark.parametrize("status", [200, 503])
def test_the_health_check_fails_unless_health_answers_200(status):
    """The HEALTHCHECK command, run against a stand-in /health on a free port: exit 0 on 200 only (the server's
    /health turns 503 while it drains or when the engine is gone)."""
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        health = dict(dockerfile_stages()[-1])["HEALTHCHECK"]
        argv = exec_form(health.split(" CMD ", 1)[1].strip())
        assert argv[0] == "python"
        argv = [sys.executable, *[a.replace("127.0.0.1:8000", f"127.0.0.1:{server.server_port}") for a in argv[1:]]]
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode == (0 if status == 200 else 1)
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_builds_and_serves_qwenserve(compose):
    assert set(compose["services"]) == {"qwenserve", "prometheus", "grafana"}
    service = compose["services"]["qwenserve"]
    context = DEPLOY / service["build"]["context"]
    assert (context / service["build"]["dockerfile"]).resolve() == ROOT / "Dockerfile"
    args = build_parser().parse_args(service["command"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert [p.rsplit(":", 1)[-1] for p in service["ports"]] == [str(args.port)]
    grace = int(service["stop_grace_period"].removesuffix("s"))
    assert grace > ServerConfig().shutdown_timeout, "docker must wait for the drain before it kills"
    final = dict(dockerfile_stages()[-1])
    cache = re.search(r"QWENSERVE_CACHE=(\S+)", final["ENV"]).group(1)
    assert [v.split(":")[1] for v in service["volumes"]] == [cache]


def test_compose_mounts_exist_and_named_volumes_are_declared(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
            else:
                assert source in compose["volumes"], f"{name}: {source}"


def test_compose_prometheus_scrapes_the_qwenserve_service(compose):
    service = compose["services"]["prometheus"]
    [config_mount] = [v for v in service["volumes"] if v.split(":")[1] == "/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load((DEPLOY / config_mount.split(":")[0]).read_text())
    base = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    [job], [base_job] = config["scrape_configs"], base["scrape_configs"]
    assert {k: job[k] for k in ("job_name", "metrics_path")} == {k: base_job[k] for k in ("job_name", "metrics_path")}
    assert job["static_configs"][0]["labels"] == base_job["static_configs"][0]["labels"]
    qwenserve = build_parser().parse_args(compose["services"]["qwenserve"]["command"])
    assert job["static_configs"][0]["targets"] == [f"qwenserve:{qwenserve.port}"]
    assert "authorization" in job or qwenserve.metrics_public, "/metrics needs the key or --metrics-public"


def test_compose_grafana_provisions_the_dashboard_on_the_prometheus_service(compose):
    service = compose["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in service["volumes"])
    provisioning = DEPLOY / next(s for s, t in mounts.items() if t == "/etc/grafana/provisioning")
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090", "the compose service on Prometheus' port"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "qwenserve.yml").read_text())["providers"]
    dashboard = mounts["./grafana/qwenserve-dashboard.json"]
    assert Path(dashboard).parent == Path(provider["options"]["path"])
    assert service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard
