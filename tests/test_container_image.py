"""The Dockerfile built for real with Debian's podman (scripts/ensure_container_builder.sh installs it) and served
from: the image without the bundled model, a tiny checkpoint mounted, /health answering and `podman stop` draining
to exit 0. Skipped, with the reason, where podman is missing or the base image cannot be pulled (no registry in
reach); tests/test_deploy_files.py reads the same files everywhere."""
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from qwenserve.distributed.groups import free_port

from helpers import save_hf_dir, tiny_hf_model

pytestmark = pytest.mark.container

REPO = Path(__file__).resolve().parent.parent
PODMAN = shutil.which("podman")
TAG = "localhost/qwenserve-test:cpu"


def base_images() -> list[str]:
    return re.findall(r"^FROM\s+(\S+)", (REPO / "Dockerfile").read_text(), flags=re.M)


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([PODMAN, *args], capture_output=True, text=True, timeout=timeout)


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@pytest.fixture(scope="module")
def image():
    if PODMAN is None:
        pytest.skip("no podman: Debian's podman package is not installed (scripts/ensure_container_builder.sh)")
    for base in set(base_images()):
        pull = run("pull", base, timeout=600)
        if pull.returncode:
            pytest.skip(f"podman cannot pull the base image {base} (no registry in reach?): {tail(pull.stderr, 3)}")
    build = subprocess.run([PODMAN, "build", "--build-arg", "BUNDLED=0", "-t", TAG, "."], cwd=REPO,
                           capture_output=True, text=True, timeout=5400)
    assert build.returncode == 0, f"podman build failed:\n{tail(build.stdout + build.stderr, 40)}"
    yield TAG
    run("rmi", "-f", TAG, timeout=120)


def test_image_serves_a_mounted_model_and_drains_on_stop(image, tmp_path):
    model = save_hf_dir(tiny_hf_model(seed=71, max_position_embeddings=256), str(tmp_path / "model"))
    port = free_port()
    name = f"qwenserve-test-{port}"
    started = run("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", "-v", f"{model}:/model:ro",
                  image, "serve", "--model", "/model", "--host", "0.0.0.0", "--port", "8000", timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, tail(run("logs", name, timeout=30).stderr, 30)
            time.sleep(1)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] is not None
        assert run("stop", "-t", "30", name, timeout=60).returncode == 0
        state = run("inspect", name, "--format", "{{.State.ExitCode}}", timeout=30)
        assert state.stdout.strip() == "0", f"exit code {state.stdout.strip()}: the SIGTERM drain did not end cleanly"
    finally:
        run("rm", "-f", name, timeout=60)
