#!/usr/bin/env bash
# What a lent GPU machine runs in one call, from the repository root, in at most ~9 minutes on one H100:
# 1. speed/gpu_step.py: DASH's optimizer step on GPT-2 124M's shapes at each matmul precision (time split
#    into refresh and plain steps, roofline, state memory, accuracy against float64, the kernel table);
# 2. numerics/roundoff.py on CUDA: how far a 1e-7 gradient perturbation moves training at each precision;
# 3. races/gpu_race.py: wall time to AdamW's loss on a GPT-2-small-shaped byte model under bf16 autocast,
#    DASH (defaults, from AdamW's tuned lr) against AdamW, Muon and Meta's Distributed Shampoo;
# 4. the CUDA tests of the optimizer; 5. memory/state_memory.py on CUDA.
# Uses the machine's python3 and torch, nothing from a package index. Meta's Distributed Shampoo comes
# from .device/site (benchmarks/prepare_device.sh installs it there and records the commit; carry .device).
# Results go to $OUT when it is set (all in one folder), else to the results/ folder beside each script.
# Each part has its own time limit, so one that hangs costs only its own.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/.device/site PYTHONUNBUFFERED=1
export DASH_COMMIT=${DASH_COMMIT:-$(cat .device/commit 2>/dev/null)}
# The folder a part of benchmarks/<$1>/ writes to: $OUT, else that folder's results/.
dest() { local folder=${OUT:-$PWD/benchmarks/$1/results}; mkdir -p "$folder"; echo "$folder"; }
nvidia-smi -L
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
python3 -c "import distributed_shampoo; print('distributed_shampoo importable')" || echo "no distributed_shampoo"
timeout 100 python3 benchmarks/speed/gpu_step.py --device cuda --profile --out "$(dest speed)" 2>&1 | grep -v USDT
timeout 40 python3 benchmarks/numerics/roundoff.py --device cuda --matmul-precisions float32 tf32 tf32x3 \
  --methods newton_db --steps 10 --out "$(dest numerics)/roundoff_cuda.json"
timeout 270 python3 benchmarks/races/gpu_race.py --device cuda --run-budget-s 75 --out "$(dest races)"
timeout 90 python3 -m pytest -q -p no:cacheprovider -m cuda tests/optim 2>&1 | tail -5
timeout 45 python3 benchmarks/memory/state_memory.py --device cuda --out "$(dest memory)"
