#!/usr/bin/env bash
# Set up, then run `samebits verify` on the built-in tiny model (CPU). Extra args pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
samebits verify "$@"
