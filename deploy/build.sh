#!/usr/bin/env bash
# Builds the `keyhome` binary as it ships and prints its path (the only line on stdout; cargo's
# progress goes to stderr). Options go to `cargo build`, e.g.:
#   deploy/build.sh --release --locked
#   deploy/build.sh --target-dir /tmp/t --features bug-injection      # a test build
#
# On Linux with glibc the binary is linked statically, as a position-independent executable
# (static-pie, so it keeps address-space randomisation): it needs no shared library at run time,
# and each start skips the dynamic loader (about 0.3 ms a start on a 2-vCPU VM, measured on
# `keyhome --version` and `keyhome lock`; docs/benchmarks.md, "Run M"). Host names still
# resolve through /etc/hosts and DNS, which glibc serves without loading a module; other
# nsswitch.conf sources (mdns, ldap, systemd-resolved's `resolve`) are skipped by a static binary
# (docs/operations.md, "Building"). On musl the target is static already.
#
# `--target` is given explicitly (the host's), so that RUSTFLAGS reach the binary and its
# libraries but not build scripts and proc macros, which cannot be static; the binary is then in
# <target-dir>/<host>/<profile>/keyhome.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

host="$("${RUSTC:-rustc}" --print host-tuple)"
case "$host" in
*-linux-gnu*) export RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C target-feature=+crt-static" ;;
esac

# Where cargo puts the binary, from the options it is given.
target_dir="${CARGO_TARGET_DIR:-target}"
profile=debug
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
    --release | -r) profile=release ;;
    --profile) profile="${args[i + 1]:-}" ;;
    --profile=*) profile="${args[i]#--profile=}" ;;
    --target-dir) target_dir="${args[i + 1]:-}" ;;
    --target-dir=*) target_dir="${args[i]#--target-dir=}" ;;
    esac
done
case "$profile" in
dev | test) profile=debug ;;
bench) profile=release ;;
esac

"${CARGO:-cargo}" build -p keyhome --bin keyhome --target "$host" "$@" >&2
binary="$target_dir/$host/$profile/keyhome"
case "$binary" in /*) ;; *) binary="$PWD/$binary" ;; esac
[ -x "$binary" ] || { echo "deploy/build.sh: no binary at $binary" >&2; exit 1; }
echo "$binary"
