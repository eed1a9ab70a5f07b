#!/usr/bin/env bash
# The container builder tests/test_container_image.py builds and runs the Dockerfile with (the `container` marker):
# Debian's podman, installed with apt-get when missing (as root, or through passwordless sudo). It never fails the
# set-up: without it, or where the base image cannot be pulled, those tests are skipped with the reason.
set -uo pipefail
if command -v podman >/dev/null; then
  exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
apt_install "the container image tests" "the container image tests will be skipped" podman
