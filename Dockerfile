# The CPU image: `qwenserve serve` on port 8000, the bundled model by default (any other with --model and a
# mounted file). torch is the CPU wheel only; the C++ kernels are prebuilt for every x86-64 family, as the set-up
# script builds them, so the image runs on any x86-64 CPU and compiles nothing at start.
#   docker build -t qwenserve:cpu .                          (--build-arg BUNDLED=0 leaves the bundled model out)
#   docker run --init -p 8000:8000 qwenserve:cpu             (stop with `docker stop -t 30`: running requests drain)
# deploy/compose.yaml runs it with Prometheus and Grafana.

FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# exactly this torch, from PyTorch's CPU index: the Linux wheel on PyPI is the multi-GB CUDA build; the constraint
# keeps every later install on it (as scripts/ensure_venv.sh does)
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install "setuptools>=68" \
 && echo "torch==2.13.0" > /opt/venv/constraints.txt
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY qwenserve qwenserve
ARG BUNDLED=1
# without build isolation, so setup.py compiles the kernels of every x86-64 family against the torch above
RUN extras=$([ "$BUNDLED" = 1 ] && echo "[bundled]" || true) \
 && pip install -c /opt/venv/constraints.txt --no-build-isolation ".$extras" \
 && python -c "import torch, qwenserve; assert torch.__version__ == '2.13.0+cpu', torch.__version__"

FROM python:3.11-slim-bookworm
# the kernels' OpenMP runtime
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 qwenserve \
 && mkdir -p /home/qwenserve/.cache/qwenserve && chown qwenserve: /home/qwenserve/.cache/qwenserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH QWENSERVE_CACHE=/home/qwenserve/.cache/qwenserve
USER qwenserve
WORKDIR /home/qwenserve
EXPOSE 8000
# the first start assembles and checks the bundled model into QWENSERVE_CACHE (a volume keeps it between runs)
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# SIGTERM (docker stop) makes the server refuse new requests and finish the running ones for --shutdown-timeout
# (20 s) before it exits 0; qwenserve runs as PID 1 (exec form), so the signal reaches it
STOPSIGNAL SIGTERM
ENTRYPOINT ["qwenserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
