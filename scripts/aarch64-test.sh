#!/usr/bin/env bash
# Cross-builds iris for aarch64-unknown-linux-gnu on an x86_64 Debian bookworm machine and runs
# its library unit tests under user-mode emulation (qemu-aarch64), without rustup targets or
# network access beyond the Debian mirror.
#
#   scripts/aarch64-test.sh [TEST-HARNESS-ARGS...]     e.g. scripts/aarch64-test.sh tq_attention
#
#   TESTS="--test *"        which cargo test targets (default "--lib": the library unit tests;
#                           "--test *": the integration tests, "--tests": both)
#   CARGO_TARGET_DIR        default /work/aarch64-target: never the x86 target/ of the checkout
#   NICE                    default 19 (the machine is shared with builds and benchmarks)
#   NO_APT=1                skip the package step (the script then only checks what it needs)
#
# The Rust: rustup's toolchains here have only the x86_64 std and rustup cannot download another
# target, so the aarch64 std comes from Debian instead: `rustc-web` is the Rust that bookworm
# keeps current for Firefox (1.85 in bookworm main, 1.96 in bookworm-security as of 2026-12), and
# `libstd-rust-web-dev:arm64` (Multi-Arch: same) puts that rustc's aarch64 std rlibs into its
# sysroot, /usr/lib/rustlib/aarch64-unknown-linux-gnu. rustup's cargo drives Debian's rustc through
# RUSTC=/usr/bin/rustc; rustup's /root/.cargo/bin/rustc stays first on PATH for everything else.
# Cargo.lock is used as is (--locked): every dependency's rust-version is <= 1.89.
#
# Prints the `test result:` lines and the build and run times at the end; the full log is in
# $CARGO_TARGET_DIR/aarch64-test.log. Exit status: that of the test run (or the build).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/aarch64-target}
NICE=${NICE:-19}
TESTS=${TESTS:---lib}
mkdir -p "$CARGO_TARGET_DIR"
LOG=$CARGO_TARGET_DIR/aarch64-test.log
: > "$LOG"

# --- 1. Debian packages ---------------------------------------------------------------------
# rustc-web                  Debian's rustc (x86_64 host); pulls libstd-rust-web-dev:amd64, the
#                            host std that build scripts and proc macros link against.
# libstd-rust-web-dev:arm64  the same rustc's std for the aarch64 target (needs the arm64
#                            architecture in dpkg; it drags libllvm22:arm64 and arm64 libc along,
#                            and apt raises zlib1g/liblzma5/libzstd1/libxml2 on amd64 to the
#                            arm64 versions, since Multi-Arch: same packages must match).
# gcc-aarch64-linux-gnu      the linker (rustc has no aarch64 linker of its own here) and the
#                            C compiler that the cc crate uses for ring and onig_sys.
# libc6-dev-arm64-cross      the aarch64 glibc headers, crt files and libc.so to link against
#                            (the cross gcc's sysroot, /usr/aarch64-linux-gnu).
# libc6:arm64 libgcc-s1:arm64  the aarch64 runtime that the test binaries load under qemu:
#                            /lib/ld-linux-aarch64.so.1 and /lib/aarch64-linux-gnu (multiarch;
#                            libstd-rust-web-dev:arm64 pulls them in anyway).
# qemu-user                  qemu-aarch64, the user-mode emulator that cargo uses as the runner.
PKGS=(rustc-web libstd-rust-web-dev:arm64 gcc-aarch64-linux-gnu libc6-dev-arm64-cross
      libc6:arm64 libgcc-s1:arm64 qemu-user)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${db:Status-Status}\n' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${NO_APT:-0}" = 1 ]; then
    echo "aarch64-test: missing Debian packages: ${missing[*]} (NO_APT=1 set)" >&2; exit 1
  fi
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  # The arm64 package lists are only fetched once the architecture is known to dpkg.
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
  fi
  # Always refresh the lists before installing: rustc-web's current version lives in
  # bookworm-security and old lists would offer an outdated one (or none for arm64).
  $SUDO nice -n "$NICE" apt-get update -q
  # rustc-web and libstd-rust-web-dev:arm64 must be the same version; apt enforces it
  # (rustc-web depends on libstd-rust-web-dev (= its version), Multi-Arch: same ties the archs).
  # No recommends: they would add cargo-web, llvm-22 and qemu-user-binfmt, none of them needed.
  $SUDO env DEBIAN_FRONTEND=noninteractive nice -n "$NICE" \
    apt-get install -y -q --no-install-recommends "${PKGS[@]}"
fi

# --- 2. The cross environment -----------------------------------------------------------------
# /usr/bin/rustc must be Debian's rustc-web (bookworm's old `rustc` 1.63 package uses the same path).
RUSTC=/usr/bin/rustc
dpkg -S "$RUSTC" 2>/dev/null | grep -q '^rustc-web:' \
  || { echo "aarch64-test: $RUSTC is not rustc-web's" >&2; exit 1; }
export RUSTC
# cargo itself: rustup's (any cargo can drive any rustc of the last years; Debian's cargo-web
# would do too). RUSTDOC likewise, for doctests if TESTS asks for them.
export RUSTDOC=/usr/bin/rustdoc
ls "$("$RUSTC" --print target-libdir --target $TARGET)"/libstd-*.rlib >/dev/null \
  || { echo "aarch64-test: no aarch64 std in $RUSTC's sysroot" >&2; exit 1; }
# Link with the cross gcc: it knows the aarch64 crt files, glibc and libgcc_s in /usr/aarch64-linux-gnu.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# The C parts of dependencies (ring's crypto and assembly, oniguruma in onig_sys): the cc crate
# looks these up per target. Host build scripts keep the native cc.
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
# cargo test runs each aarch64 test binary through qemu. The binaries are dynamically linked
# (glibc, libgcc_s); qemu gets no -L: the interpreter /lib/ld-linux-aarch64.so.1 and the libraries
# in /lib/aarch64-linux-gnu are the multiarch libc6:arm64, one glibc build. NOT the usual
# `-L /usr/aarch64-linux-gnu`: with it qemu takes ld.so from the cross sysroot (glibc 2.36-8cross1)
# but, not finding /usr/aarch64-linux-gnu/lib/aarch64-linux-gnu, falls back to the host's
# /lib/aarch64-linux-gnu/libc.so.6 (2.36-9+deb12u14): a mismatched ld.so/libc pair, and every
# pthread_create then spins forever (C programs as well as Rust's thread::spawn and libtest).
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=qemu-aarch64
[ -e /lib/ld-linux-aarch64.so.1 ] || { echo "aarch64-test: no /lib/ld-linux-aarch64.so.1 (libc6:arm64)" >&2; exit 1; }
# No target-cpu for aarch64: the baseline armv8-a has NEON, which candle's quantized kernels use;
# .cargo/config.toml's x86-64-v3 applies to the x86_64 target only.
# The test run uses the release profile as the x86 suite does (opt-level 3 under [profile.test]
# anyway; --release additionally matches the cfg(debug_assertions) of the release build).

{
  echo "== $(date -u +%FT%TZ) aarch64-test"
  echo "rustc:  $("$RUSTC" -V) ($(dpkg-query -W -f='${Version}' rustc-web); aarch64 std $(dpkg-query -W -f='${Version}' libstd-rust-web-dev:arm64))"
  echo "cargo:  $(cargo -V)"
  echo "linker: $(aarch64-linux-gnu-gcc --version | head -1)"
  echo "qemu:   $(qemu-aarch64 --version | head -1)"
} | tee -a "$LOG"

# --- 3. Build (no run) then run, to time them apart ------------------------------------------
# TESTS split on blanks, never globbed (TESTS="--test *" means every integration test).
read -ra targets <<< "$TESTS"
CARGO=(cargo test --release --locked --target $TARGET "${targets[@]}")
t0=$(date +%s)
set +e
nice -n "$NICE" "${CARGO[@]}" --no-run 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
t1=$(date +%s)
if [ "$rc" = 0 ]; then
  # The test binaries themselves run under emulation: a few times slower than native.
  nice -n "$NICE" "${CARGO[@]}" -- "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
fi
t2=$(date +%s)
set -e

echo
echo "== summary ($LOG)"
grep -E '^test result:|^error|FAILED|panicked' "$LOG" | sed -n '1,60p' || true
echo "build: $((t1 - t0)) s; test run under qemu: $((t2 - t1)) s; exit status $rc"
exit "$rc"
