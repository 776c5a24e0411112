#!/usr/bin/env bash
# The vLLM engine's checks on an NVIDIA GPU. No result of it is in the repository: the vLLM
# engine has run on CPU only (see STATUS.md).
#
#   bash agents/engines/vllm_engine/gpu_check.sh [OUT_DIR]     (from the repository root)
#
# 1. makes its own virtualenv (.venv-gpu) with the CUDA `vllm` wheel (the `vllm` extra; pip
#    resolves the CUDA torch that vLLM pins) and `ucxx-cu12` (the `ucx` extra);
# 2. runs the vLLM engine's correctness tests: engine level, a request migrated between two
#    vLLM agents over TCP and UCX, its tokens equal to an unmigrated greedy run, and the abort
#    paths (finished / preempted mid-copy, source / destination killed) (junit XML);
# 3. runs `shoal bench migration --engine vllm --transport ucx` and `--transport tcp` on a random
#    checkpoint of the torch `kv-heavy` shape (128 KiB of KV per token), whose KV lives in GPU
#    memory: UCX moves CUDA tensors device to device (GPUDirect where UCX finds it);
#    then `shoal bench vllm-serve` (shoal up --engine vllm vs vllm serve, with vllm bench serve);
# 4. writes OUT_DIR/gpu-check.json: the machine (nvidia-smi), the versions, each step's exit
#    status and wall time, and the paths of the test report and the two benchmark JSONs.
# Every step runs even if an earlier one failed; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${1:-out/gpu-check}
mkdir -p "$out"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no nvidia-smi here; this script is for a machine with an NVIDIA GPU" >&2
  exit 2
fi
PY=${PYTHON:-python3}
venv=.venv-gpu
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
declare -A status seconds
step() {  # step NAME COMMAND...: run, record the exit status and the wall time
  local name=$1; shift
  local started=$SECONDS
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1
  status[$name]=$?
  seconds[$name]=$((SECONDS - started))
  echo "   exit ${status[$name]} after ${seconds[$name]} s (log: $out/$name.log)"
}
step install "$venv/bin/python" -m pip install -q --upgrade pip
step install_shoal "$venv/bin/python" -m pip install -q -e ".[dev,vllm,ucx]"
step tests env UCX_TLS=all "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  --junitxml="$out/tests.xml" \
  tests/agents/engines/test_vllm_engine.py tests/agents/engines/test_vllm_config.py \
  tests/agents/engines/test_vllm_cli.py tests/agents/migration/test_vllm.py \
  tests/agents/migration/test_engine_aborts.py
step checkpoint "$venv/bin/python" -c "
from agents.engines.vllm_engine.checkpoint import CheckpointSpec, build_checkpoint
build_checkpoint('$out/kv-heavy-checkpoint', CheckpointSpec(
    hidden_size=256, intermediate_size=512, num_layers=16, num_heads=8, num_kv_heads=8,
    head_dim=128, max_position_embeddings=8192, dtype='float16'))"
for transport in ucx tcp; do
  step "bench_$transport" "$venv/bin/shoal" bench migration --engine vllm \
    --model "$out/kv-heavy-checkpoint" --max-model-len 8448 --seq-lens 256,1024,2048,4096,8192 \
    --repeats 5 --transport "$transport" --json "$out/migration-vllm-gpu-$transport.json" \
    --plot "$out/migration-vllm-gpu-$transport.png"
done
step bench_serve "$venv/bin/shoal" bench vllm-serve --num-prompts 100 --concurrency 8 --concurrency 32 \
  --log-dir "$out/vllm-serve" --json "$out/vllm-serve-gpu.json"
failed=0
{
  printf '{\n "machine": %s,\n' "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | "$venv/bin/python" -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))')"
  printf ' "versions": %s,\n' "$("$venv/bin/python" -c '
import importlib.metadata as m, json
names = ("vllm", "torch", "ucxx-cu12", "shoal")
found = {}
for name in names:
    try:
        found[name] = m.version(name)
    except m.PackageNotFoundError:
        found[name] = None
print(json.dumps(found))')"
  printf ' "steps": {\n'
  first=1
  for name in install install_shoal tests checkpoint bench_ucx bench_tcp bench_serve; do
    [ "$first" = 1 ] || printf ',\n'
    first=0
    printf '  "%s": {"exit": %s, "seconds": %s, "log": "%s"}' "$name" "${status[$name]:-null}" \
      "${seconds[$name]:-null}" "$out/$name.log"
    [ "${status[$name]:-1}" = 0 ] || failed=1
  done
  printf '\n },\n "tests": "%s",\n "bench": ["%s", "%s", "%s"]\n}\n' "$out/tests.xml" \
    "$out/migration-vllm-gpu-ucx.json" "$out/migration-vllm-gpu-tcp.json" "$out/vllm-serve-gpu.json"
} > "$out/gpu-check.json"
echo "wrote $out/gpu-check.json"
exit "$failed"
