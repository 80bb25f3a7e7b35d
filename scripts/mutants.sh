#!/usr/bin/env bash
# Mutation checks (scripts/mutants.py): each batch-invariant piece swapped for a stock twin
# in a temporary copy of src/ and tests/; reports "mutant X: killed by N tests" or "SURVIVED".
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" scripts/mutants.py "$@"
