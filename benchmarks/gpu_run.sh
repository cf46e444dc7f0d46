#!/usr/bin/env bash
# Several measurements on one GPU machine in one go, each under its own timeout, every result packed into one
# archive. Run from the repository root on any GPU machine:
#   bash benchmarks/gpu_run.sh 'NAME SECONDS COMMAND...' ['NAME SECONDS COMMAND...' ...]
# Each COMMAND runs with PYTHONPATH=.(:/tmp/site when wheels were installed) and R=<results folder> set; its
# output goes to $R/NAME.log (the last lines are printed). Where a folder .whl/ of wheels exists (see
# benchmarks/device_wheels.sh, for machines without a package index), they are installed into /tmp/site first.
# The archive is $OUT/results.tgz ($OUT, or the current folder), rewritten after each job (weights and checkpoint
# files left out); it also holds the GPU's name and the versions.
#   bash benchmarks/gpu_run.sh 'bw 60 python3 benchmarks/copy_bandwidth.py --out $R/copy_bandwidth.json'
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} NCCL_NVLS_ENABLE=0
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: the wheels in .whl/ did not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:. PATH=/tmp/site/bin:$PATH
fi
R=$(mktemp -d); export R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.csv" 2>&1
python3 -c "import torch, deepspeed; print(torch.__version__, torch.version.cuda, deepspeed.__version__)" > "$R/versions.txt" 2>&1
git rev-parse HEAD > "$R/commit.txt" 2>/dev/null || true
for job in "$@"; do
  read -r name seconds cmd <<< "$job"
  start=$(date +%s)
  timeout "$seconds" bash -c "$cmd" > "$R/$name.log" 2>&1
  rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s"
  tail -n 8 "$R/$name.log"
  # after every job, so a call cut off at its limit still returns what the jobs before it measured
  tar czf "${OUT:-.}/results.tgz" --exclude='*.safetensors' --exclude='*.pt' -C "$R" .
done
