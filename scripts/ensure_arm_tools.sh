#!/usr/bin/env bash
# The tools tests/test_arm_kernels.py uses to test the ARM kernels on another CPU: Debian's aarch64 cross-compiler
# (g++-aarch64-linux-gnu, with the aarch64 C++ runtime the emulated programs load) and qemu-user (qemu-aarch64),
# installed with apt-get when missing (as root, or through passwordless sudo). On an aarch64 machine the test
# compiles and runs natively and needs neither. It never fails the set-up: without them the ARM tests are skipped
# with a reason naming what is missing.
set -uo pipefail
if [ "$(uname -m)" = aarch64 ]; then
  exit 0
fi
if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then
  exit 0
fi
warn() { echo "warning: g++-aarch64-linux-gnu / qemu-user not installed ($1); the ARM kernel tests will be skipped" >&2; exit 0; }
command -v apt-get >/dev/null || warn "no apt-get here"
if [ "$(id -u)" = 0 ]; then
  sudo=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo="sudo -n"
else
  warn "not root and no passwordless sudo"
fi
echo "installing g++-aarch64-linux-gnu and qemu-user (apt-get) for the ARM kernel tests ..." >&2
install() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++-aarch64-linux-gnu qemu-user >&2; }
# a fresh image may have no package lists yet: update once, then try again
install || { $sudo apt-get update -q >&2 && install; } || warn "apt-get install failed"
