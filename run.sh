#!/usr/bin/env bash
# The main job on the bundled model. With no arguments: a chat completion; otherwise the arguments go to
# `qwenserve` (e.g. ./run.sh generate --prompt "def fib(n):"). Sets up .venv on first use.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/ensure_venv.sh
if [ $# -eq 0 ]; then
  set -- generate --chat --max-tokens 128 --prompt "Write a Python function that checks whether a number is prime."
fi
exec .venv/bin/qwenserve "$@"
