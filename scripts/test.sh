#!/usr/bin/env bash
# The test command (README): installs what the suite needs, then runs pytest on CPU.
# torch is pinned to 2.13.0 first so pip takes the CPU build (an unpinned torch can pull
# a multi-GB CUDA build); triton is pinned to 3.6.0, the H200 machine's version, so the
# interpreter (TRITON_INTERPRET=1) tests the language the GPU compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q "triton==3.6.0" "safetensors>=0.4" numpy tqdm "transformers>=5.17" "pytest>=8" "setuptools>=77" wheel
$PY -m pip install -q --no-deps --no-build-isolation -e .
exec $PY -m pytest -q "$@"
