#!/usr/bin/env bash
# The whole test suite, on a fresh machine too: installs what the tests run against where it is
# missing, then runs `cargo test --workspace`. Arguments go to cargo test (`tests/run.sh
# cluster::` runs the tests whose name holds `cluster::`; `tests/run.sh -- --nocapture`).
#
# What the tests need beyond a Rust toolchain, all from Debian's packages:
#   etcd-server          the cluster tests run a real etcd (one per test, on free loopback ports);
#   mesa-vulkan-drivers  GPU devices are tested on Mesa's software adapters: Vulkan on lavapipe
#   libvulkan1           (this driver and its loader), OpenGL on llvmpipe (libegl-mesa0,
#   libegl-mesa0         libgl1-mesa-dri);
#   libgl1-mesa-dri
# Installing takes root: this script uses sudo when it is not run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

needed=(etcd-server mesa-vulkan-drivers libvulkan1 libegl-mesa0 libgl1-mesa-dri)
missing=()
for pkg in "${needed[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "tests/run.sh: install ${missing[*]} (Debian's names) with your package manager, then run it again" >&2
    exit 1
  fi
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "tests/run.sh: installing ${missing[*]} needs root or sudo" >&2; exit 1; }
    sudo=(sudo)
  fi
  echo "tests/run.sh: installing ${missing[*]}" >&2
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Under CI (CI=true) lints come with the build, as errors: clippy's driver compiles ferry's own
# crates (cargo's workspace wrapper), so the lints cost no second, check-only compile of every
# dependency (a third of a cold CI), and the benches, which `cargo test` does not build, are built
# too. Not locally: cargo builds the dependencies apart for a wrapped build, and a plain `cargo
# test` or `cargo build` afterwards would build them all again (`cargo clippy` lints locally).
if [ "${CI:-}" = true ]; then
  if clippy-driver --version >/dev/null 2>&1; then
    export RUSTC_WORKSPACE_WRAPPER=clippy-driver
    # How cargo-clippy hands clippy-driver its arguments: `-D warnings`.
    export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
  else
    echo "tests/run.sh: no clippy-driver (rustup component add clippy): built without lints" >&2
  fi
  cargo test --workspace --locked --benches --no-run
fi

exec cargo test --workspace --locked "$@"
