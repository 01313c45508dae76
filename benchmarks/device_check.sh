#!/usr/bin/env bash
# The GPU check (issue 12): the test suite, decode_speed and hf_parity on CUDA, in one short run.
#   bash benchmarks/device_check.sh [OUT_DIR]
# Environment: PYTHON (default .venv/bin/python; any Python with a CUDA torch and pivotspec importable),
# PYTEST_ARGS (extra pytest arguments, e.g. "-n 8" where pytest-xdist is installed), TEST_TIMEOUT (seconds, 900).
# Writes OUT_DIR/device_check.txt (what it saw: GPU, versions, test summary, the two benchmark tables),
# OUT_DIR/decode_speed_cuda.json and OUT_DIR/hf_parity_cuda.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/device_check}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), '| transformers', transformers.__version__)"
  # Convert SmolLM2 and build the testbed models once, before parallel test workers would race to do it.
  echo "--- models loaded on cuda"
  timeout 300 "$py" -c "
import pivotspec
from pivotspec.models import load_lm
for name in ('smollm2-135m-instruct', 'testbed-target', 'testbed-draft'):
    lm = load_lm(name, device='cuda')
    print(name, lm.device, lm.model.dtype)"
  echo "--- tests on cuda"
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  PIVOTSPEC_TEST_DEVICE=cuda PIVOTSPEC_REQUIRE_SMOLLM2=1 timeout "${TEST_TIMEOUT:-900}" \
      "$py" -m pytest -q -rfEs ${PYTEST_ARGS:-} 2>&1 | tail -40
  echo "tests exit: ${PIPESTATUS[0]}"
  echo "--- decode_speed on cuda (testbed pair, bfloat16)"
  timeout 240 "$py" benchmarks/decode_speed.py --device cuda --target testbed-target --draft testbed-draft \
      --dtype bfloat16 --draft-dtype bfloat16 --n 8 --repeats 3 --gammas 3,5,8 --out "$out/decode_speed_cuda.json" \
      2>&1 | tail -14
  echo "--- hf_parity on cuda (testbed target, full-vocabulary testbed draft, bfloat16)"
  timeout 240 "$py" benchmarks/hf_parity.py --device cuda --target testbed-target --draft testbed-draft-full \
      --dtype bfloat16 --draft-dtype bfloat16 --n 8 --repeats 3 --out "$out/hf_parity_cuda.json" 2>&1 | tail -10
} 2>&1 | tee "$out/device_check.txt"
