#!/usr/bin/env bash
# Set up shoal in ./.venv from the project's own files.
#   ./install.sh          runtime dependencies
#   ./install.sh --dev    plus test and lint tools
# torch: on a machine without an NVIDIA GPU this installs the CPU build 2.13.0
# (with pip: it finds the local CPU wheel where one is provided); with a GPU,
# pip resolves the CUDA build that the version range in pyproject.toml allows.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
.venv/bin/python -m pip install -q -e ".${extra}"
echo "shoal installed in $(pwd)/.venv"
