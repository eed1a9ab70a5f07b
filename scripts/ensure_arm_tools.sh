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
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
apt_install "the ARM kernel tests" "the ARM kernel tests will be skipped" g++-aarch64-linux-gnu qemu-user
