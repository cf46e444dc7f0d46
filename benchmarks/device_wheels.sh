#!/usr/bin/env bash
# Fills DIR (default .whl) with the wheels that a GPU machine without a package index (Python 3.12, torch 2.11
# cu130) lacks for fluxzero's benchmarks: deepspeed (sdist-only upstream, built here as a pure py3-none-any
# wheel without compiled ops, DS_BUILD_OPS=0: DeepSpeed JIT-builds any op it needs on the GPU machine, which
# has nvcc and ninja), the packages it needs that the GPU image lacks, and diffusers (the baseline).
# Run on a machine that reaches the package index, from the repository root:
#   bash benchmarks/device_wheels.sh [DIR]
# DIR is emptied of wheels first, so it holds exactly the set below; a DIR holding anything but wheels is
# refused. The pins are listed in benchmarks/README.md (tests/benchmarks/test_benchmarks.py keeps the two in step).
# Then copy .whl/ to the GPU machine's clone: benchmarks/gpu_run.sh installs it, or by hand
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl || exit 1; export PYTHONPATH=/tmp/site:.
set -eu
DIR=${1:-.whl}
DS_VERSION=${DS_VERSION:-0.19.8}
# torchao: FP8 training (fluxzero.fp8), the quantized LoRA base and the bf16 optimizer modes; 0.17.0 for the GPU
# image's torch 2.11 (benchmarks/RESULTS.md records what it ran); its wheel is tagged manylinux_2_24
PINS="diffusers==0.42.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 hjson==3.1.0 torchao==0.17.0"

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
other=$(find "$DIR" -mindepth 1 -maxdepth 1 ! -name '*.whl' | head -n 3)
if [ -n "$other" ]; then
  echo "error: $DIR holds files other than wheels ($(echo $other | tr ' ' ',')); name an empty folder or one with wheels only." >&2
  exit 2
fi
find "$DIR" -mindepth 1 -maxdepth 1 -name '*.whl' -delete  # no stale wheel of another version stays behind

# shellcheck disable=SC2086 - PINS is a list of words
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" $PINS

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: "deepspeed==$DS_VERSION" -d "$tmp"
tar xzf "$tmp/deepspeed-$DS_VERSION.tar.gz" -C "$tmp"
python3 -m pip install -q wheel setuptools >/dev/null 2>&1 || true  # the sdist builds without isolation
(cd "$tmp/deepspeed-$DS_VERSION" && DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation . -w "$DIR")
ls -1 "$DIR"
