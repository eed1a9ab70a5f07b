#!/usr/bin/env bash
# The whole test suite, as CI runs it: every marker, the bundled-model tests included. Sets up .venv on first use.
# Arguments go to pytest. The loop to run while editing is `./test.sh -m quick` (under a minute on two cores once
# the CPU kernels are built, which the first run does): the tests without the markers slow, browser, ray, multiproc
# or kernels (pyproject.toml lists what each means; e.g. ./test.sh -m "quick or multiproc" adds the process tests).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/ensure_venv.sh
bash scripts/ensure_browser.sh  # the Chromium tests/test_web_ui.py drives (a no-op once installed)
bash scripts/ensure_arm_tools.sh  # the aarch64 cross-compiler and qemu tests/test_arm_kernels.py use (likewise)
bash scripts/ensure_prometheus.sh  # the Prometheus server tests/test_prometheus.py scrapes qwenserve with (likewise)
bash scripts/ensure_container_builder.sh  # the podman tests/test_container_image.py builds the image with (likewise)
exec .venv/bin/python -m pytest -q "$@"
