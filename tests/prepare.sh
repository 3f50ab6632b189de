#!/usr/bin/env bash
# Installs what the test suite needs beyond a Rust toolchain, when it is missing (Debian packages,
# with apt-get, as root): curl and python3 for the HTTP API tests, promtool (package prometheus),
# headless Chromium and a font for the metrics and status-page tests, glibc's static library for
# the shipped (static) binary. Part of the README's test command; `.ci/run` runs that command.
set -euo pipefail

# The HTTP API tests drive the nodes with curl and python3 (standard library only).
if ! command -v curl >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq curl
fi
command -v python3 >/dev/null 2>&1 || { echo "python3 not found: the HTTP API tests need it" >&2; exit 1; }

# The multi-process tests run the binary as it ships: deploy/build.sh links it statically on
# glibc, which needs glibc's static library (libc.a, package libc6-dev).
if [ "$(cc -print-file-name=libc.a 2>/dev/null)" = libc.a ] && ldd --version 2>&1 | grep -qi glibc; then
  need_libc=1
fi

# tests/tests/observe.rs parses a scrape with `promtool check metrics` and loads the status page
# in headless Chromium: both from Debian's packages, installed here when missing.
need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -d /usr/share/fonts/truetype/dejavu ] || need+=(fonts-dejavu-core)
[ -z "${need_libc:-}" ] || need+=(libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "--- apt-get install ${need[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
  else
    echo "missing ${need[*]}: install them (Debian: apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
