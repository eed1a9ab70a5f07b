#!/usr/bin/env bash
# The browser that tests/test_web_ui.py drives: Debian's chromium and chromium-driver, installed with apt-get
# when missing (as root, or through passwordless sudo). It never fails the set-up: without a browser the web UI
# tests fail and say what to install.
set -uo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
warn() { echo "warning: chromium / chromium-driver not installed ($1); the web UI tests will fail" >&2; exit 0; }
command -v apt-get >/dev/null || warn "no apt-get here"
if [ "$(id -u)" = 0 ]; then
  sudo=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo="sudo -n"
else
  warn "not root and no passwordless sudo"
fi
echo "installing chromium and chromium-driver (apt-get) for the web UI tests ..." >&2
install() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver >&2; }
# a fresh image may have no package lists yet: update once, then try again
install || { $sudo apt-get update -q >&2 && install; } || warn "apt-get install failed"
