#!/usr/bin/env bash
# The GPU check (issue 12): the test suite on CUDA, then decode_speed on CUDA, in one short run.
#   bash benchmarks/device_check.sh [OUT_DIR]        (needs ./.venv from install.sh and a CUDA torch)
# Writes OUT_DIR/device_check.txt (what it saw: GPU, torch, test summary) and OUT_DIR/decode_speed_cuda.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  echo "--- tests on cuda"
  PIVOTSPEC_TEST_DEVICE=cuda PIVOTSPEC_REQUIRE_SMOLLM2=1 timeout 900 "$py" -m pytest -q -x 2>&1 | tail -15
  echo "tests exit: ${PIPESTATUS[0]}"
  echo "--- decode_speed on cuda (testbed pair)"
  timeout 600 "$py" benchmarks/decode_speed.py --device cuda --target testbed-target --draft testbed-draft \
      --dtype bfloat16 --draft-dtype bfloat16 --n 8 --repeats 3 --gammas 3,5,8 --out "$out/decode_speed_cuda.json" 2>&1 | tail -12
} | tee "$out/device_check.txt"
