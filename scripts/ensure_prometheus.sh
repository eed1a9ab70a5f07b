#!/usr/bin/env bash
# The Prometheus server tests/test_prometheus.py runs against a live qwenserve (the `prometheus` marker): Debian's
# prometheus package, installed with apt-get when missing (as root, or through passwordless sudo). Only the binary
# is used; the test starts its own server with a generated config. It never fails the set-up: without it those
# tests are skipped with a reason naming the package.
set -uo pipefail
if command -v prometheus >/dev/null || [ -x /usr/bin/prometheus ]; then
  exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
apt_install "the Prometheus integration tests" "the Prometheus tests will be skipped" prometheus
