#!/usr/bin/env bash
# The two points of pyproject's ranges CI tests beside the pin (scripts/test.sh), each in a venv
# of its own (docs/transformers-versions.md says what is tested where):
#
#   bash scripts/test-versions.sh floor    # each direct dependency at pyproject's floor
#                                          # (scripts/constraints-floor.txt): all but the slow tests
#   bash scripts/test-versions.sh newest   # the newest releases pip resolves from pyproject alone:
#                                          # the whole suite; a failure here fails CI
#   bash scripts/test-versions.sh verl     # verl 0.9.1's environment (scripts/constraints-verl.txt,
#                                          # transformers 5.10.4): the verl backend's test and
#                                          # the drift probe
#
# torch is the CPU 2.13.0 in both: the newer torch the registry has is a CUDA build of several GB,
# and torch's floor (2.11) runs on the GPU machine. Extra args pass to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
point=${1:-}
shift || true
case "$point" in
floor) venv=.venv-floor constraints=(-c scripts/constraints-floor.txt) ;;
newest) venv=.venv-newest constraints=() ;;
verl) venv=.venv-verl constraints=(-c scripts/constraints-verl.txt) ;;
*)
    sed -n 2,14p "$0"
    exit 2
    ;;
esac
[ "$point" = newest ] && rm -rf $venv  # fresh: what pip resolves today, not what it resolved before
[ -x $venv/bin/python ] || python3 -m venv $venv
. $venv/bin/activate
python -m pip install -q --upgrade pip > /dev/null
python -m pip install -q "torch==2.13.0"
# the floor leaves the trl extra out: TRL's datasets/pyarrow need NumPy 2, numpy's floor is 1.26
extras=test,plot,trl
[ "$point" = floor ] && extras=test,plot
[ "$point" = verl ] && extras=test,verl  # verl's numpy>=2 and transformers<5.11 beside the trl extra's
python -m pip install -q ${constraints[@]+"${constraints[@]}"} -e ".[$extras]"
python -m pip list 2> /dev/null | grep -iE '^(torch|transformers|numpy|safetensors|rich|fastapi|uvicorn|prometheus.client|kernels|huggingface.hub) '
if [ "$point" = verl ]; then
    python -m pip list 2> /dev/null | grep -iE '^(verl|ray|tensordict) '
    python -m pytest -q -p no:cacheprovider tests/test_integration_verl.py tests/test_drift.py "$@"
elif [ "$point" = floor ]; then
    python -m pytest -q -p no:cacheprovider -m "not slow" "$@"  # the core: all but the slow tests
else
    python -m pytest -q -p no:cacheprovider "$@"
fi
