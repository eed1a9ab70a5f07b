#!/usr/bin/env bash
# Sourced by the set-up scripts that install Debian packages for a group of tests:
#   apt_install "<what they are for>" "<warning when missing>" package ...
# installs the packages with apt-get (as root, or through passwordless sudo). It never fails the set-up: where it
# cannot install, it prints the warning and returns.
apt_install() {
  local purpose=$1 missing=$2 sudo
  shift 2
  warn() { echo "warning: $1 not installed ($2); $missing" >&2; }  # packages, reason
  command -v apt-get >/dev/null || { warn "$*" "no apt-get here"; return 0; }
  if [ "$(id -u)" = 0 ]; then
    sudo=""
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    warn "$*" "not root and no passwordless sudo"; return 0
  fi
  echo "installing $* (apt-get) for $purpose ..." >&2
  install() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >&2; }
  # a fresh image may have no package lists yet: update once, then try again
  install "$@" || { $sudo apt-get update -q >&2 && install "$@"; } || warn "$*" "apt-get install failed"
  return 0
}
