#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA (run by hand on the device machine; CI has no GPU):
# every CUDA-marked test (two-GPU ones run when two GPUs are there), then the GPU overhead figures.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off (shared machines): NCCL, PyTorch symmetric memory, NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
# Every CUDA-marked test of the suite (the recorder, checksums, memory, watch, step log, determinism),
# then the tests of the recorder's hot paths on a machine whose torch is a CUDA build.
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/ 2>&1 | tail -${GPU_TEST_TAIL:-25}
"$PY" -m pytest -q -p no:cacheprovider tests/test_backward_hooks.py tests/test_stories.py -k "not page" 2>&1 | tail -5
"$PY" benchmarks/steplog_overhead.py --device cuda 2>&1 | tail -12
"$PY" benchmarks/overhead.py --device cuda --model "${GPU_MODEL:-gpt2-small}" --warmup 1 --repeats "${GPU_REPEATS:-3}" \
    --configs "${GPU_CONFIGS:-plain,nostacks,stacks,fast,md5,numerics,anomaly,profiler,debugmode}" 2>&1 | tail -24
