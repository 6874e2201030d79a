#!/usr/bin/env bash
# The GGUF oracle against llama.cpp (tests/test_gguf_llama_cpp_oracle.py, marker llama_cpp): builds
# llama-cpp-python into the active environment when it is missing (a portable build: a native one crashes on the
# 2-core machines; ~20 min on 2 cores), fetches its source distribution for llama.cpp's converter, and runs the
# tests. CI's default run skips them (no llama_cpp there, no LLAMA_CPP_SRC).
#
# Usage: scripts/check_gguf_oracle.sh [pytest args...]   (from the repository root, venv active)
# LLAMA_CPP_SRC=/path/to/llama.cpp reuses a source tree instead of fetching one.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
VERSION=0.3.36
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/ninfer-dev"

if ! python -c "import llama_cpp" 2>/dev/null; then
    echo "building llama-cpp-python $VERSION (portable CPU build; takes minutes)..." >&2
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF" \
        python -m pip install "llama-cpp-python==$VERSION"
fi

if [ -z "${LLAMA_CPP_SRC:-}" ]; then
    src="$CACHE/llama_cpp_python-$VERSION"
    if [ ! -f "$src/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
        mkdir -p "$CACHE"
        python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
        tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
    fi
    export LLAMA_CPP_SRC="$src/vendor/llama.cpp"
fi

exec python -m pytest -p no:xdist -o addopts="" -m llama_cpp tests/test_gguf_llama_cpp_oracle.py tests/test_gguf_mmproj.py -rA "$@"
