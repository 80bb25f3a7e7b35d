#!/usr/bin/env bash
# Create .venv and install samebits with its test, plot and trl extras (the tests check the
# PNGs). CPU torch is pinned (torch==2.13.0 is the CPU wheel this machine kind carries);
# transformers and matplotlib are pinned to the versions CI tests (scripts/constraints.txt;
# the package itself accepts ranges).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "torch==2.13.0"
python -m pip install -q -c scripts/constraints.txt -e ".[test,plot,trl]"
