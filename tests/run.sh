#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what the tests run against where it is
# missing, then runs `cargo test --workspace`. Arguments go to cargo test (`tests/run.sh
# cluster::` runs the tests whose name holds `cluster::`; `tests/run.sh -- --nocapture`).
#
# What the tests need beyond a Rust toolchain:
#   etcd 3.4 or later    the cluster tests run a real etcd (one per test, on free loopback ports),
#                        reached through its JSON gateway (`/v3/`, from 3.4 on);
#   Mesa's drivers       GPU devices are tested on Mesa's software adapters: Vulkan on lavapipe
#                        (its driver and the Vulkan loader), OpenGL on llvmpipe (EGL, DRI).
# On Debian and Ubuntu they are installed where missing (etcd-server, mesa-vulkan-drivers,
# libvulkan1, libegl-mesa0, libgl1-mesa-dri), as root or with sudo; elsewhere the script says
# what to install.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "tests/run.sh: $*" >&2
  exit 1
}

# etcd's own version, as `etcd --version` prints it (`etcd Version: 3.4.23`), as MAJOR.MINOR.
etcd_version() {
  etcd --version 2>/dev/null | sed -n 's/^etcd Version: \([0-9]*\.[0-9]*\).*/\1/p' | head -n1
}

etcd_usable() {
  local v
  v=$(etcd_version)
  [ -n "$v" ] || return 1
  [ "${v%%.*}" -gt 3 ] || { [ "${v%%.*}" -eq 3 ] && [ "${v#*.}" -ge 4 ]; }
}

installed() {
  [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

if command -v dpkg-query >/dev/null && command -v apt-get >/dev/null; then
  missing=()
  etcd_usable || missing+=(etcd-server)
  for pkg in mesa-vulkan-drivers libvulkan1 libegl-mesa0 libgl1-mesa-dri; do
    installed "$pkg" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    as_root=()
    if [ "$(id -u)" -ne 0 ]; then
      command -v sudo >/dev/null || fail "installing ${missing[*]} needs root or sudo"
      as_root=(sudo)
    fi
    echo "tests/run.sh: installing ${missing[*]}" >&2
    "${as_root[@]}" apt-get update -qq
    # `env`, since sudo resets the environment.
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
etcd_usable || fail "the cluster tests need etcd 3.4 or later on PATH (found: $(etcd_version || true))"
# (ldconfig is in /sbin, which a user's PATH may lack; read whole, so no pipe can break early.)
libraries=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
if ! ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 \
  || ! grep -q 'libvulkan\.so\.1' <<<"$libraries"; then
  fail "the GPU tests need Mesa's Vulkan driver (lavapipe) and the Vulkan loader (libvulkan.so.1)"
fi

exec cargo test --workspace --locked "$@"
