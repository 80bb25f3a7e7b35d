#!/usr/bin/env bash
# Fetch, on this machine, the wheels a lent GPU machine lacks into .whl/ (ignored by git), so
# `scripts/device_run.sh` installs them there: the transformers version CI pins (the device
# image has 5.17.0), what the serve tests need (fastapi, uvicorn, openai and their needs) and TRL
# (the `trl` log-prob lines run TRL's own Triton kernels on CUDA; `trl.kernels` needs no more)
# and Liger (0.8.5, GPU only, for tests/test_logprob_formula_fused.py's fused linear CE tests).
# Versions: scripts/constraints.txt for the pinned ones, the versions CI resolved for the rest.
# The device image already has torch, triton, numpy, safetensors, huggingface_hub, tokenizers,
# rich, prometheus-client, click, httpx and pytest (anyio, idna, h11 and typing_extensions
# come here too: the versions the wheels above need, whatever the image holds).
#
# `scripts/device_wheels.sh trl` fills .whl-trl/ instead, for `device_run.sh trl-steps`: TRL's
# GRPOTrainer needs `datasets`, whose pyarrow and pandas wheels leave no room beside .whl in the
# 64 MiB a device call carries, so that phase carries .whl-trl alone (with the device image's
# transformers 5.17, inside samebits' range): TRL, accelerate, datasets and their needs, pyarrow at the
# smallest release datasets 5.2 takes (24.0). pandas, python-dateutil, six and psutil come from the
# device image (device KINDS.md lists them): with pandas' 12 MB wheel the folder and the tree
# passed the 64 MiB a call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.whl-trl/' .git/info/exclude 2>/dev/null || echo '/.whl-trl/' >> .git/info/exclude
pin() { grep -i "^$1==" scripts/constraints.txt; }
get() {  # get DIR SPEC...: the CPython 3.12 manylinux wheels of SPEC into DIR
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
if [ "${1:-}" = trl ]; then
    get .whl-trl "$(pin trl)" datasets==5.2.0 pyarrow==24.0.0 dill==0.4.1 multiprocess==0.70.19 \
        xxhash==4.1.0 fsspec==2026.9.0 accelerate==1.16.0
    du -sh .whl-trl
    exit 0
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    "$(pin transformers)" "$(pin trl)" "$(pin fastapi)" "$(pin uvicorn)" "$(pin openai)" \
    starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 \
    annotated-types==0.8.0 annotated-doc==0.0.7 opentelemetry-api==1.45.3 \
    httpx2==2.17.0 httpcore2==2.17.0 jiter==0.19.0 sniffio==1.3.1 truststore==0.10.5 \
    anyio==4.16.0 idna==3.21 h11==0.16.0 typing_extensions==4.16.0 \
    liger-kernel==0.8.5
ls .whl
