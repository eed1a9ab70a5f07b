#!/usr/bin/env bash
# The whole test suite, the bundled-model tests included. Sets up .venv on first use.
# Arguments go to pytest (e.g. ./test.sh -m "not slow" for the quick loop).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/ensure_venv.sh
bash scripts/ensure_browser.sh  # the Chromium tests/test_web_ui.py drives (a no-op once installed)
exec .venv/bin/python -m pytest -q "$@"
