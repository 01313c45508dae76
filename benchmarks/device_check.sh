#!/usr/bin/env bash
# The GPU check: tests on CUDA, decode speed, batched throughput and the serving load test, made to fit the
# lent machine (../shared/docs/gpu-check.md): no network there, 64 MiB carried per call, SmolLM2 (98 MB) does
# not fit. So:
#   bash benchmarks/device_check.sh prepare       HERE, once: .device/ (ignored) gets the wheels the GPU image
#       lacks (fastapi, uvicorn, pydantic, ...: the server) and SmolLM2's config and tokenizer (no weights); it
#       prints what a call would carry and fails above 64 MiB.
#   bash benchmarks/device_check.sh [tests|bench|all] [OUT]     THERE (run with carry [".device"]): installs the
#       wheels into /tmp/site, builds SmolLM2-shaped random weights (benchmarks/device_models.py: speed only,
#       acceptance means nothing), then `tests` (the suite on CUDA without what needs the real models) and/or
#       `bench` (decode_speed, batch_throughput, serve_batching with the builtin client: guidellm's wheels do
#       not fit beside the repository), and/or `vllm` (the plugin's tests, where the image has vLLM 0.32.0: the
#       lent image has no vLLM and nothing can install it there, no network and 64 MiB per call against vLLM's
#       ~500 MB, so there it prints "skipped"). Separate phases, so each call stays well inside 10 minutes; a
#       warm machine keeps /tmp between back-to-back calls.
#   DEVICE=cpu QUICK=1 PY=.venv/bin/python bash benchmarks/device_check.sh all /tmp/dry    the dry run here:
#       the same commands on the CPU with smaller sizes.
# Writes OUT/device_check.txt (what it saw) and the benchmarks' JSON files into OUT (default $OUT, else
# benchmarks/results/device_check).
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
if [ "$phase" = prepare ]; then
  set -e
  py=${PY:-.venv/bin/python}
  rm -rf .device && mkdir -p .device/whl .device/smollm2
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .device/whl fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
      annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2 2>&1 \
      | grep -v "^WARNING" || true
  src=$("$py" -c "from pivotspec import api; print(api.model_dir('smollm2-135m-instruct'))")
  for f in config.json generation_config.json tokenizer_config.json chat_template.jinja; do
    [ -f "$src/$f" ] && cp "$src/$f" .device/smollm2/
  done
  gzip -9 -c "$src/tokenizer.json" > .device/smollm2/tokenizer.json.gz
  tracked=$(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c)
  extra=$(du -sb .device | cut -f1)
  untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r cat 2>/dev/null | wc -c)
  total=$((tracked + extra + untracked))
  echo "a call carries $((total / 1048576)) MiB (tracked $((tracked / 1048576)), untracked $((untracked / 1048576)), .device $((extra / 1048576))) of 64"
  [ "$total" -le $((64 * 1048576)) ] || { echo "over 64 MiB: nothing would travel" >&2; exit 1; }
  exit 0
fi
case "$phase" in tests|bench|vllm|all) ;; *) echo "usage: device_check.sh [prepare|tests|bench|vllm|all] [OUT]" >&2; exit 2 ;; esac
out=${2:-${OUT:-benchmarks/results/device_check}}
mkdir -p "$out"
py=${PY:-python3}
device=${DEVICE:-cuda}
quick=${QUICK:-0}
export PIVOTSPEC_CACHE=${PIVOTSPEC_CACHE:-/tmp/pivotspec-cache} PYTHONUNBUFFERED=1
if [ -d .device/whl ] && ! "$py" -c "import fastapi, uvicorn" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device/whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-}
dtype=$([ "$device" = cpu ] && echo float32 || echo bfloat16)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) phase: $phase device: $device quick: $quick"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available',
torch.cuda.is_available(), '| transformers', transformers.__version__)"
  if [ -d .device/smollm2 ]; then timeout 300 "$py" benchmarks/device_models.py; fi
  echo "--- models load on $device"
  timeout 300 "$py" -c "
from pivotspec import api
for name in ('testbed-target', 'testbed-draft'):
    lm = api.load_model(name, device='$device')
    print(name, lm.device, lm.model.dtype)"
  if [ "$phase" = tests ] || [ "$phase" = all ]; then
    echo "--- tests on $device (tiny random checkpoints; what needs the real models is left out)"
    files="tests/test_batch.py tests/test_sampling.py tests/test_architectures.py tests/test_decoding.py"
    [ "$quick" = 1 ] && files="tests/test_batch.py tests/test_architectures.py"
    # shellcheck disable=SC2086  # a list of files
    PIVOTSPEC_TEST_DEVICE=$device timeout "${TEST_TIMEOUT:-240}" "$py" -m pytest -q -rfEs -p no:cacheprovider \
        -n "${WORKERS:-8}" -k "not testbed and not smollm2" $files 2>&1 | tail -15
    echo "tests exit: ${PIPESTATUS[0]}"
  fi
  if [ "$phase" = bench ] || [ "$phase" = all ]; then
    n=$([ "$quick" = 1 ] && echo 4 || echo 32)
    echo "--- decode_speed on $device (testbed pair on random SmolLM2 weights, $dtype: speed only)"
    timeout 180 "$py" benchmarks/decode_speed.py --device "$device" --target testbed-target --draft testbed-draft \
        --dtype "$dtype" --draft-dtype "$dtype" --n "$([ "$quick" = 1 ] && echo 2 || echo 8)" --repeats 2 \
        --gammas 5 --out "$out/decode_speed.json" 2>&1 | tail -8
    echo "--- batch_throughput on $device (ar, sd, pad at batch 1, 8, 32)"
    timeout 240 "$py" benchmarks/batch_throughput.py --device "$device" --dtype "$dtype" --n "$n" \
        --batch-sizes "$([ "$quick" = 1 ] && echo 1,2 || echo 1,8,32)" \
        --max-new-tokens "$([ "$quick" = 1 ] && echo 24 || echo 160)" --out "$out/batch_throughput.json" 2>&1 \
        | tr '\r' '\n' | grep -v "^problems " | tail -14
    echo "batch_throughput exit: ${PIPESTATUS[0]} (124: timed out)"
    echo "--- serve_batching on $device (builtin client, --max-batch 1 against 8)"
    timeout 240 "$py" benchmarks/serve_batching.py --client builtin --device "$device" --dtype "$dtype" \
        --concurrency "$([ "$quick" = 1 ] && echo 2 || echo 1,8,16)" --requests "$([ "$quick" = 1 ] && echo 4 || echo 0)" \
        --max-batch "$([ "$quick" = 1 ] && echo 2 || echo 8)" --max-tokens "$([ "$quick" = 1 ] && echo 24 || echo 128)" \
        --out "$out/serve_batching.json" 2>&1 | tail -10
    echo "serve_batching exit: ${PIPESTATUS[0]} (124: timed out)"
  fi
  [ "$phase" = vllm ] || [ "$phase" = all ] && echo "--- PAD inside vLLM (issue 31): the plugin's tests, when the image has vLLM $(
    "$py" -c "from pivotspec.integrations.vllm.patches import SUPPORTED_VLLM as v; print(v)" 2>/dev/null)"
  if { [ "$phase" = vllm ] || [ "$phase" = all ]; } && "$py" -c "import vllm, sys; from pivotspec.integrations.vllm.patches import SUPPORTED_VLLM as v;
sys.exit(vllm.__version__ != v)" 2>/dev/null; then
    # vLLM finds the plugin by its entry point, which only an installed pivotspec has
    "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
    # eager (no CUDA-graph capture in a 5-minute budget), and room for the test's two engines side by side
    PIVOTSPEC_VLLM_ARGS=${PIVOTSPEC_VLLM_ARGS:-'{"enforce_eager": true, "gpu_memory_utilization": 0.3}'} \
    PIVOTSPEC_VLLM_PYTHON=$(command -v "$py") timeout 300 "$py" -m pytest -q -rfEs -p no:cacheprovider -n 0 \
        tests/test_vllm_plugin.py 2>&1 | tail -8
    echo "vllm plugin tests exit: ${PIPESTATUS[0]}"
    PIVOTSPEC_VLLM_ARGS=${PIVOTSPEC_VLLM_ARGS:-'{"enforce_eager": true, "gpu_memory_utilization": 0.3}'} \
    PIVOTSPEC_VLLM_PYTHON=$(command -v "$py") timeout 400 "$py" benchmarks/vllm_checks.py --out "$out/vllm_checks.json" \
        2>&1 | tail -3
    echo "vllm checks exit: ${PIPESTATUS[0]}"
  elif [ "$phase" = vllm ] || [ "$phase" = all ]; then
    echo "skipped: $("$py" -c "import vllm; print('vLLM', vllm.__version__)" 2>&1 | tail -1) (the plugin pins one version)"
  fi
} 2>&1 | tee "$out/device_check.txt"
