#!/usr/bin/env bash
# Create .venv and install samebits with its test extras. CPU torch is pinned
# (torch==2.13.0 is the CPU wheel this machine kind carries); transformers is
# pinned to the version CI tests (the package itself accepts >=5.17,<6).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "torch==2.13.0"
python -m pip install -q -c scripts/constraints.txt -e ".[test]"
