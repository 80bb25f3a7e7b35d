#!/usr/bin/env bash
# The GPU work queued for the next GPU machine (issue 45; method, floors and results in
# docs/speed-measurements.md), one phase a device call (each fits the 600 s a call may run):
#
#   bash scripts/device_run.sh tests-new   # the GPU tests of code changed since the last GPU run
#   bash scripts/device_run.sh tests-all   # every GPU test
#   bash scripts/device_run.sh sample      # benchmarks/narrow_rows.py: the sampler's rows with rules
#   bash scripts/device_run.sh tiles       # decode GEMMs fed by TMA inside CUDA graphs
#   bash scripts/device_run.sh prefill-ab  # the bench's prefill, async scheduling off / on / off
#   bash scripts/device_run.sh budget      # the bench's prefill at 8192 / 16384 / 32768 tokens a step
#   bash scripts/device_run.sh bench       # samebits bench exact,fast at 1, 64 and the largest batch
#                                          # that fits 1k context: 96 on an H100, 256 on an H200 (~450 s)
#   bash scripts/device_run.sh omni        # samebits bench exact at 1 and 64 on the Qwen3-Omni thinker
#                                          # (48 layers, random, /dev/shm/omni48; removes /dev/shm/q48:
#                                          # host memory holds one of them), for the Omni-vs-Qwen target
#   bash scripts/device_run.sh profile     # benchmarks/decode_profile.py, every kernel of a decode step
#                                          # at batch 1 and 64, exact and fast, 48 layers (~300 s)
#   bash scripts/device_run.sh probe       # the 48-layer probe: 0 mismatches in every exact arm
#   bash scripts/device_run.sh probe-formulas  # the 48-layer probe on the trl and verl lines at
#                                          # T 0.7 and 1.3 (issue 42), 300 tokens a request
#                                          # (PROBE_ARMS="trl:0.7 verl:1.3" runs those only)
#   bash scripts/device_run.sh trl-steps   # benchmarks/trl_grpo_steps.py: TRL's GRPOTrainer, 3 steps,
#                                          # 48 layers: on an H200 trainer + engine copy (~122 GB), on an
#                                          # H100 --share-weights (one copy); carry .whl-trl only
#                                          # (`scripts/device_wheels.sh trl`)
#
# Run from the repository root on the device machine, with `.whl` carried (scripts/device_wheels.sh
# fetches it here). Logs and JSONs go to $OUT (the device tool's folder that comes back).
# The 48-layer random checkpoint is written once a machine to /dev/shm/q48 (~45-75 s).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
tests-new | tests-all | sample | tiles | prefill-ab | budget | bench | omni | profile | probe | probe-formulas | trl-steps) ;;
*)
    sed -n 2,29p "$0"
    exit 2
    ;;
esac
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
wheels=$(ls .whl/*.whl .whl-trl/*.whl 2> /dev/null || true) # either folder, or both
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $wheels || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src
else
    export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory >> 30, 'GiB')"
big_gpu=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > (100 << 30)))")
q48=/dev/shm/q48

checkpoint() {
    [ -f $q48/config.json ] || python3 -c "from pathlib import Path; from samebits.bench.core import write_random_checkpoint
write_random_checkpoint(Path('$q48'), 48, seed=0)"
}

run() {  # run NAME CMD...: the command's output to the terminal and $OUT/NAME.log
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
}

case "${1:-}" in
tests-new)
    # changed since the GPU run of 2026-12-07 (fa9085f): trl on CUDA (the -inf stand-in once a
    # call), slime's flattened bucket over CUDA IPC, prompt_logprobs scored on CUDA
    run tests-new python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_logprobs_mode.py \
        tests/test_logprob_formula_fused.py tests/test_logprob_formula_tops.py tests/test_weight_sync_gpu.py \
        tests/test_prompt_logprobs.py
    ;;
tests-all)
    run tests-all python3 -m pytest -q -m gpu -p no:cacheprovider tests
    ;;
sample)
    run sample python3 benchmarks/narrow_rows.py --batches 1,64,256
    ;;
tiles)
    run tiles python3 benchmarks/matmul_decode.py --ms 64,128,256 --shapes q+k+v,o_proj --configs "" \
        --tma-configs "64,128,4,4;64,64,4,4;64,128,4,3;128,64,4,4;128,128,8,3;64,256,8,3"
    ;;
prefill-ab)
    checkpoint
    for arm in no-async-scheduling async-scheduling no-async-scheduling; do
        run "prefill-$arm" python3 -m samebits.cli bench --model $q48 --arms exact --batches 64 \
            --num-prompts 0 "--$arm" --out "$OUT/prefill-$arm"
    done
    ;;
budget)
    checkpoint
    for tokens in 8192 16384 32768; do
        run "budget-$tokens" python3 -m samebits.cli bench --model $q48 --arms exact --batches 64 \
            --num-prompts 0 --max-num-batched-tokens $tokens --out "$OUT/budget-$tokens"
    done
    ;;
bench)
    checkpoint
    batches=1,64,96 # 96 sequences of 1k context: the most that fit beside the 48 layers on an H100
    [ "$big_gpu" = 1 ] && batches=1,64,256 # 256 on an H200
    # stopped before the device call's 600 s (SECONDS: since this script began, checkpoint
    # included); bench.json is rewritten after each arm, so a stopped run keeps the exact arm
    run bench timeout $((585 - SECONDS)) python3 -m samebits.cli bench --model $q48 --arms exact,fast --batches $batches \
        --num-prompts 0 --out "$OUT/bench"
    ;;
omni)
    rm -rf $q48
    [ -f /dev/shm/omni48/config.json ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path; from probe_omni import write_random_thinker
write_random_thinker(Path('/dev/shm/omni48'), 48, 0, 'cuda')"
    run omni timeout $((585 - SECONDS)) python3 -m samebits.cli bench --model /dev/shm/omni48 --arms exact \
        --batches 1,64 --num-prompts 0 --out "$OUT/omni"
    ;;
profile)
    checkpoint
    run profile timeout $((585 - SECONDS)) python3 benchmarks/decode_profile.py --layers 48 --dir $q48 --batches 1,64 \
        --arms exact,fast --context 1024 --json "$OUT/profile.json"
    ;;
probe)
    checkpoint
    run probe python3 benchmarks/probe_real_shape.py --layers 48 --tokens 500 --dir $q48 --reuse \
        --out "$OUT/probe.json"
    ;;
probe-formulas)
    checkpoint
    for arm in ${PROBE_ARMS:-trl:0.7 trl:1.3 verl:0.7 verl:1.3}; do # formula:temperature
        formula=${arm%:*} t=${arm#*:}
        run "probe-$formula-$t" python3 benchmarks/probe_real_shape.py --layers 48 --tokens 300 --dir $q48 \
            --reuse --logprob-formula $formula --temperature $t --out "$OUT/probe-$formula-$t.json"
    done
    ;;
trl-steps)
    share=--share-weights # an H100: the engine on the trainer's tensors (one 61 GB copy)
    [ "$big_gpu" = 1 ] && share= # an H200: the trainer's model and the engine's own copy
    run trl-steps timeout $((585 - SECONDS)) python3 benchmarks/trl_grpo_steps.py --layers 48 \
        --dir $q48 --steps 3 --freeze experts $share --out "$OUT/trl-steps.json"
    ;;
esac
