#!/usr/bin/env bash
# The browser that tests/test_web_ui.py drives: Debian's chromium and chromium-driver, installed with apt-get
# when missing (as root, or through passwordless sudo). It never fails the set-up: without a browser the web UI
# tests fail and say what to install.
set -uo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
apt_install "the web UI tests" "the web UI tests will fail" chromium chromium-driver
