#!/usr/bin/env bash
# Install torch into the venv given as $1 without ever pulling a CUDA build onto a CPU machine.
#  - NVIDIA GPU present: the CUDA build the GPU checks ran on (bench.gpu_check, tests/gpu; the
#    code leans on flex_attention and dynamo internals that move between releases), pinned;
#    deploy/docker/Dockerfile installs the same (tests/deploy checks they agree).
#  - otherwise: torch 2.13.0's CPU wheel, from a local wheel directory when pip's config has one
#    (no download), else from the PyTorch CPU index.
set -euo pipefail
GPU_TORCH="2.11.0"
GPU_INDEX="https://download.pytorch.org/whl/cu130"
PIP="$1/bin/pip"
if "$1/bin/python" -c "import torch" 2>/dev/null; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "install_torch: NVIDIA GPU found, installing torch $GPU_TORCH (CUDA 13.0)"
  "$PIP" install -q "torch==$GPU_TORCH" --index-url "$GPU_INDEX" \
    --extra-index-url https://pypi.org/simple
elif "$PIP" install -q --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
  echo "install_torch: installed the local CPU wheel of torch 2.13.0"
  "$PIP" install -q "torch==2.13.0"   # its small pure-Python dependencies
else
  echo "install_torch: installing torch 2.13.0 from the PyTorch CPU index"
  "$PIP" install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
    --extra-index-url https://pypi.org/simple
fi
