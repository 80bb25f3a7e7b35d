set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -c "import torch,transformers,triton;print(torch.__version__,transformers.__version__,triton.__version__)"
git log --oneline | head -1 || true
python3 benchmarks/probe_real_shape.py --layers 48 --tokens 500 --temperature 0.7 --dir /dev/shm/q48 --out $OUT/probe48_t07.json 2>&1 | grep -v "Loading\|Writing" 
python3 benchmarks/probe_real_shape.py --layers 48 --tokens 500 --temperature 1.3 --dir /dev/shm/q48 --reuse --out $OUT/probe48_t13.json 2>&1 | grep -v "Loading\|Writing"
python3 benchmarks/probe_real_shape.py --layers 48 --tokens 1000 --temperature 1.0 --dir /dev/shm/q48 --reuse --out $OUT/probe48_t10.json 2>&1 | grep -v "Loading\|Writing"
