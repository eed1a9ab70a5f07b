#!/usr/bin/env bash
# The main job: with no arguments, serve the bundled model over the OpenAI API on http://127.0.0.1:8000/v1;
# otherwise the arguments go to `qwenserve` (e.g. ./run.sh generate --prompt "def fib(n):").
# Sets up .venv on first use.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/ensure_venv.sh
if [ $# -eq 0 ]; then
  set -- serve
fi
exec .venv/bin/qwenserve "$@"
