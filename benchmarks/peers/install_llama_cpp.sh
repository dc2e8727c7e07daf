#!/usr/bin/env bash
# Installs llama.cpp's Python bindings (llama-cpp-python 0.3.36, which vendors llama.cpp and builds it with CMake) in a
# virtualenv of its own, outside the repository (default ~/.cache/pagoda/peers/llamacpp-venv), for
# benchmarks/llama_cpp_peer.py and benchmarks/quality.py's K-quant files. Not run by CI (a CPU build of the shared
# library: 84 min on the shared 2-vCPU VM at load 15-40).
# Usage: benchmarks/peers/install_llama_cpp.sh [VENV_DIR] [--tools]
#
# Recipe (docs/benchmarks.md, "Side by side with llama.cpp"):
#   1. cmake and ninja from PyPI wheels where the system lacks them (the sdist needs CMake >= 3.21; nothing but PyPI
#      is reachable);
#   2. llama-cpp-python==0.3.36 from its sdist with CMAKE_ARGS for a CPU build with AVX-512 (F, VNNI, BF16, VBMI)
#      named explicitly rather than -march=native, so that the build is the same on any AVX-512 host; the multimodal
#      library (LLAVA_BUILD) is off: the benchmarks run a text model;
#   3. with --tools, the vendored llama.cpp's own programs (llama-quantize, llama-bench, llama-lookup,
#      llama-perplexity) built from the same source with the same flags into VENV_DIR/llama.cpp-bin: the wheel ships
#      only the shared libraries (llama-cpp-python builds llama.cpp as a subproject, which turns its tools off).
#      The Python API covers what the benchmarks need (llama_cpp.llama_model_quantize is llama-quantize's function).
set -euo pipefail

VENV="${1:-$HOME/.cache/pagoda/peers/llamacpp-venv}"
TOOLS="${2:-}"
PY="${PYTHON:-python3}"
VERSION="0.3.36"
JOBS="${JOBS:-2}"
CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_OPENMP=ON"

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  "$VENV/bin/pip" install -q cmake ninja
  export PATH="$VENV/bin:$PATH"
fi
CMAKE_ARGS="$CPU_FLAGS -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
  "$VENV/bin/pip" install -v --no-cache-dir "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"

if [ "$TOOLS" = "--tools" ]; then
  SRC="$(mktemp -d)"
  "$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$VERSION"
  tar xzf "$SRC"/llama_cpp_python-"$VERSION".tar.gz -C "$SRC"
  LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
  # shellcheck disable=SC2086
  cmake -S "$LLAMA" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF $CPU_FLAGS
  cmake --build "$SRC/build" -j "$JOBS" --target llama-quantize llama-bench llama-lookup llama-perplexity
  mkdir -p "$VENV/llama.cpp-bin"
  cp "$SRC"/build/bin/llama-{quantize,bench,lookup,perplexity} "$VENV/llama.cpp-bin/"
  rm -rf "$SRC"
  echo "tools: $VENV/llama.cpp-bin"
fi
echo "installed: $VENV (pass --llama-venv $VENV to benchmarks/llama_cpp_peer.py)"
