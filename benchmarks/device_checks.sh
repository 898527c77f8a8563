#!/usr/bin/env bash
# What a lent GPU machine runs in one call, from the repository root: the CUDA tests, then the
# micro-group, async-overlap and step-time benchmarks on CUDA (docs/benchmarks.md, "On an H100",
# has the results). Uses the machine's own python3 and torch; results go to $OUT (default
# benchmarks/results). Each part has its own time limit, so one that hangs costs only its own;
# about four minutes on an H100. eigh at f = 1 takes 3 s a step there: it is left out.
set -uo pipefail
out=${OUT:-$PWD/benchmarks/results}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m cuda tests/optim tests/distributed 2>&1 | tail -5
cd benchmarks
timeout 110 python3 micro_groups.py --device cuda --out "$out"
timeout 120 python3 async_overlap.py --device cuda --output "$out/async_overlap_cuda.json"
timeout 100 python3 async_overlap.py --device cuda --frequencies 10 --max-staleness 3 \
  --output "$out/async_overlap_cuda_staleness3.json"
timeout 120 python3 step_time.py --device cuda --model gpt2-125m --solvers newton_db --block-sizes 1024 \
  --dtypes float32 bfloat16 --no-third-party --no-loop --out "$out"
