#!/usr/bin/env bash
# The lettered GPU runs ("call A" ...) behind the older rows of benchmarks/RESULTS.md, kept as they ran: several
# measurements a run, each under its own timeout, all results packed into one archive under $OUT.
# benchmarks/gpu_run.sh is the maintained form.
#   bash benchmarks/gpu_session.sh A|B
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0
R=/tmp/res; mkdir -p $R; OUTDIR=${OUT:-.}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
python3 -c "import torch,deepspeed;print(torch.__version__,torch.version.cuda,deepspeed.__version__)" > $R/versions.txt 2>&1
case "$1" in
A)
  (OUT=$R timeout 110 python3 benchmarks/bench_blocks.py > $R/bench_blocks.log 2>&1)
  tail -15 $R/bench_blocks.log
  (OUT=$R timeout 180 python3 benchmarks/nccl_profiles.py > $R/nccl.log 2>&1)
  tail -30 $R/nccl.log
  timeout 290 python3 benchmarks/sweep.py --set lite1 --parallel 2 --budget 270 --out $R > $R/lite1.out 2>&1
  tail -25 $R/lite1.out
  ;;
B)
  timeout 410 python3 benchmarks/sweep.py --set dev2 --budget 395 --out $R > $R/dev2.out 2>&1
  tail -15 $R/dev2.out
  timeout 110 python3 benchmarks/sweep.py --name scale --model flux-dev-lite --gpus 1,2 --zero 3 --ckpt 1 --mb 8 --res 512 --budget 100 --out $R > $R/scale.out 2>&1
  tail -4 $R/scale.out
  timeout 60 python3 benchmarks/sweep.py --name lite_after --model flux-dev-lite --gpus 1 --zero 0 --ckpt 0,1 --mb 8 --res 512 --budget 55 --out $R > $R/lite_after.out 2>&1
  tail -4 $R/lite_after.out
  ;;
C)
  timeout 130 python3 benchmarks/ckpt_zero3.py --model flux-tiny --res 512 --precision bf16 --steps 5 --out $R/ckpt_zero3.json > $R/ckpt.out 2>&1
  tail -12 $R/ckpt.out
  (OUT=$R timeout 60 python3 benchmarks/memory_calibration.py --blocks > $R/mem_blocks.out 2>&1)
  tail -8 $R/mem_blocks.out
  timeout 250 python3 benchmarks/sweep.py --name dev2b --model flux-dev --gpus 2 --zero 3,2 --ckpt 1 --mb 1 --res 512 --budget 160 --out $R > $R/dev2b.out 2>&1
  timeout 100 python3 benchmarks/sweep.py --name dev2c --model flux-dev --gpus 2 --zero 3 --ckpt 1 --mb 4 --res 1024 --budget 90 --out $R > $R/dev2c.out 2>&1
  tail -4 $R/dev2b.out $R/dev2c.out
  ;;
D)
  timeout 150 python3 benchmarks/ckpt_zero3.py --model flux-tiny --res 512 --precision bf16 --steps 4 --out $R/ckpt_zero3.json > $R/ckpt.out 2>&1
  tail -12 $R/ckpt.out
  ;;
E)  # issue 23: the 24 GB LoRA --fit picks; issue 27: zero2-offload's slow start (py-spy dumps while it runs), zero3-offload
  export PATH=/tmp/site/bin:$PATH  # py-spy's wheel installs its binary there (without this, call E's dumps failed)
  timeout 280 python3 benchmarks/capped_runs.py --set fit --cases fit-lora16-512px-24gb --timeout 265 --memory-cap-gib 23.6 \
     --out $R/capped_fit.jsonl > $R/capped_e.log 2>&1; tail -3 $R/capped_e.log
  (timeout 190 python3 benchmarks/offload_presets.py --presets zero2-offload --model flux-tiny --res 256 --steps 4 \
     --timeout 80 --out $R/op > $R/op_z2.log 2>&1) &
  last=0; for t in 35 70; do sleep $((t - last)); last=$t
    for p in $(pgrep -f "launch/train.py" | head -3); do
      echo "== t=$t pid $p" >> $R/spy.txt; timeout 20 py-spy dump --pid $p >> $R/spy.txt 2>&1; done; done
  wait; tail -4 $R/op_z2.log
  timeout 100 python3 benchmarks/offload_presets.py --presets zero3-offload --model flux-tiny --res 256 --steps 4 \
     --timeout 60 --out $R/op > $R/op_z3.log 2>&1; tail -4 $R/op_z3.log
  ;;
F)  # issue 23: the 24 GB and 16 GB LoRA as --fit writes them, with py-spy dumps of the trainer every 50 s
  export PATH=/tmp/site/bin:$PATH
  (while sleep 50; do for p in $(pgrep -f "fluxzero.train.loop import main" | head -2); do
     echo "== $(date +%T) pid $p" >> $R/spy.txt; timeout 15 py-spy dump --pid $p >> $R/spy.txt 2>&1; done; done) &
  spy=$!
  timeout 330 python3 benchmarks/capped_runs.py --set fit --cases fit-lora16-512px-24gb --timeout 320 --memory-cap-gib 23.6 \
     --workdir $R/cw --out $R/capped_fit.jsonl > $R/capped_f1.log 2>&1; tail -3 $R/capped_f1.log
  timeout 230 python3 benchmarks/capped_runs.py --set fit --cases fit-lora16-512px-16gb --timeout 220 --memory-cap-gib 15.6 \
     --workdir $R/cw --out $R/capped_fit.jsonl > $R/capped_f2.log 2>&1; tail -3 $R/capped_f2.log
  kill $spy; rm -rf $R/cw/*/run/checkpoints
  ;;
G)  # issue 23 again after the quantized base stopped switching on Inductor's coordinate-descent tuning
  for c in "fit-lora16-512px-24gb 150 23.6" "fit-lora16-512px-16gb 125 15.6" "fit-lora16-1024px-24gb 135 23.6" \
           "fit-full-512px-80gb 165 79.1"; do read -r n t cap <<< "$c"
    timeout $((t + 8)) python3 benchmarks/capped_runs.py --set fit --cases $n --timeout $t --memory-cap-gib $cap \
       --workdir $R/cw --out $R/capped_fit.jsonl > $R/capped_$n.log 2>&1; tail -1 $R/capped_$n.log
  done; rm -rf $R/cw/*/run/checkpoints
  ;;
H)  # issue 22 target 5/6: the full FLUX.1-dev fine-tune as --fit writes it, FP8, bf16-sr at mb 16, an EMA's cost
  timeout 570 python3 benchmarks/defaults_speed.py --cases full-fit,full-fit-fp8,full-sr-ck1,full-sr-ck1-ema \
     --timeout 130 --rows 7 --out $R/defaults_full.jsonl > $R/full_h.log 2>&1; tail -8 $R/full_h.log
  ;;
I)  # issue 22: the optimizer step per mode (bf16-kahan fused vs eager), the full fine-tune as --fit writes it again
    # (fused bf16-kahan) and with bf16-sr pinned, the LoRA at 1024 px
  timeout 170 python3 benchmarks/optim_step_speed.py --model flux-dev --out $R/optim_step.jsonl > $R/optim_i.log 2>&1
  tail -5 $R/optim_i.log
  timeout 400 python3 benchmarks/defaults_speed.py --cases full-fit,full-fit-sr,lora-1024-mb1 \
     --timeout 125 --rows 7 --out $R/defaults_full2.jsonl > $R/full_i.log 2>&1; tail -6 $R/full_i.log
  ;;
J)  # issue 22 target 6: fluxzero sample vs FluxPipeline (1024 px, 28 steps, 4 images), the EMA update (fp32, bf16)
  timeout 330 python3 benchmarks/sample_speed.py --rows fluxzero,diffusers,fluxzero-batch4 --budget-s 290 \
     --out $R/sample_speed.jsonl > $R/sample_j.log 2>&1; tail -8 $R/sample_j.log
  timeout 110 python3 benchmarks/sample_speed.py --ema --out $R/ema_update.jsonl > $R/ema_j.log 2>&1; tail -4 $R/ema_j.log
  timeout 110 python3 benchmarks/sample_speed.py --ema --ema-section '{"dtype": "bf16"}' --out $R/ema_update.jsonl \
     > $R/ema_j2.log 2>&1; tail -4 $R/ema_j2.log
  ;;
K)  # issue 23: the full fine-tune on a 48 GB card (cap 44.4 GiB, an L40S as torch reports it) with 120 GiB of host,
    # as --fit writes it (ZeRO-3, optimizer offload, cpu-adamw8bit-sr: the step runs on the host)
  (while sleep 60; do echo "== $(date +%T)"; free -g | head -2; nvidia-smi --query-gpu=memory.used --format=csv; done) > $R/mon.txt 2>&1 &
  timeout 540 python3 benchmarks/capped_runs.py --set fit --cases fit-full-512px-48gb --timeout 520 --memory-cap-gib 44.4 \
     --workdir $R/cw --out $R/capped_fit48.jsonl > $R/capped_k.log 2>&1; tail -3 $R/capped_k.log
  tail -30 $R/cw/*/train.log; rm -rf $R/cw/*/run/checkpoints
  ;;
L)  # issue 23: the 48 GB full fine-tune's steady state after the host step's rework (8-bit code tables, hash noise);
    # issue 22 target 6: the bf16 EMA update as one compiled kernel
  timeout 110 python3 benchmarks/sample_speed.py --ema --ema-section '{"dtype": "bf16"}' --out $R/ema_update.jsonl \
     > $R/ema_l.log 2>&1; tail -4 $R/ema_l.log
  (while sleep 30; do echo "== $(date +%T)"; free -g | head -2; top -bn1 | head -12 | tail -6
     nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done) > $R/mon.txt 2>&1 &
  timeout 440 python3 benchmarks/capped_runs.py --set fit --cases fit-full-512px-48gb --timeout 425 --memory-cap-gib 44.4 \
     --workdir $R/cw --out $R/capped_fit48.jsonl > $R/capped_l.log 2>&1; tail -3 $R/capped_l.log
  cp $R/cw/*/run/metrics.jsonl $R/capped_fit48_metrics.jsonl 2>/dev/null; tail -12 $R/cw/*/train.log
  rm -rf $R/cw/*/run/checkpoints
  ;;
M)  # issue 22 target 6: the EMA update replayed as a CUDA graph (against the kernels launched one by one, same call);
    # issue 23: the host optimizer step alone on this machine's 16 cores; issue 22: FP8 on the fused bf16-kahan step,
    # and target 7's profile of the LoRA at 1024 px, mb 1 (the row missing 1.3x)
  timeout 150 python3 benchmarks/sample_speed.py --ema --ema-section '{"dtype": "bf16"}' --out $R/ema_update.jsonl \
     > $R/ema_m.log 2>&1; tail -4 $R/ema_m.log
  timeout 130 python3 benchmarks/cpu_adam_speed.py --params 5e8 --steps 2 --no-deepspeed --out $R > $R/cpu_adam.log 2>&1
  tail -6 $R/cpu_adam.log
  timeout 150 python3 benchmarks/defaults_speed.py --cases full-fit-fp8 --timeout 140 --rows 7 \
     --out $R/defaults_fp8.jsonl > $R/fp8_m.log 2>&1; tail -4 $R/fp8_m.log
  python3 -m fluxzero.cli gen-config --preset zero2 --model flux-dev --micro-batch 1 --checkpoint-every 1 -o $R/lora1024.json
  timeout 200 python3 benchmarks/sweep.py --name lora1024prof --model flux-dev --lora-rank 16 --ds-json $R/lora1024.json \
     --res 1024 --profile --warmup 2 --steps 2 --workers 4 --budget 190 --out $R > $R/lora_prof.out 2>&1; tail -30 $R/lora_prof.out
  ;;
N)  # issue 22 target 6: fluxzero sample's speed options (compile, cuDNN attention, batch 4, no grid) vs FluxPipeline
    # eager and under cuDNN attention, each with one profiled denoising step
  timeout 300 python3 benchmarks/sample_speed.py --rows diffusers,fluxzero-fast,fluxzero-cudnn,diffusers-cudnn,fluxzero-compile,fluxzero \
     --runs 2 --profile --budget-s 275 --out $R/sample_speed.jsonl > $R/sample_n.log 2>&1; tail -30 $R/sample_n.log
  ;;
Q)  # planned (not yet run), lost call P's commands plus the host step alone. Issue 23: the 48 GB full fine-tune
    # with the compiled host step, and that step alone on the GPU machine's cores; issue 22 target 4: the LoRA
    # after the batched gradient checks (mb 1 at 512 and 1024 px, the rows that missed 1.3x)
  (while sleep 20; do echo "== $(date +%T)"; free -g | head -2; top -bn1 | head -8 | tail -2
     nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done) > $R/mon.txt 2>&1 &
  timeout 215 python3 benchmarks/capped_runs.py --set fit --cases fit-full-512px-48gb --timeout 205 --steps 3 --warmup 1 \
     --memory-cap-gib 44.4 --workdir $R/cw --out $R/capped_fit48.jsonl > $R/capped_q.log 2>&1; tail -3 $R/capped_q.log
  cp $R/cw/*/run/metrics.jsonl $R/capped_fit48_metrics.jsonl 2>/dev/null; tail -5 $R/cw/*/train.log
  rm -rf $R/cw/*/run/checkpoints; kill %1
  timeout 130 python3 benchmarks/cpu_adam_speed.py --params 5e8 --steps 2 --no-deepspeed --out $R > $R/host_optim.log 2>&1
  tail -8 $R/host_optim.log
  timeout 175 python3 benchmarks/defaults_speed.py --cases lora-mb1,lora-1024-mb1 --timeout 85 --rows 6 \
     --out $R/defaults_lora.jsonl > $R/lora_q.log 2>&1; tail -5 $R/lora_q.log
  ;;
R)  # planned (not yet run): issue 22 target 2, flux-dev-lite checkpointed at mb 16 and 8 against the compiled peer
    # at the same settings and the eager peer (same call)
  timeout 490 python3 benchmarks/defaults_speed.py --cases lite-ckpt1,lite-ckpt1-mb8,peer:lite-ckpt1,peer:lite-ckpt1-mb8,peer:lite-ckpt1-eager \
     --timeout 95 --rows 8 --out $R/defaults_lite2.jsonl > $R/lite_r.log 2>&1; tail -8 $R/lite_r.log
  ;;
S)  # planned (not yet run): issue 23 item 2a, ZeRO-3 parameter offload for the 24 GB LoRA with gen-config's prefetch
    # against one block prefetched (mb 1 and 4, same call); issue 22 target 6, sampling's isolated --compile row
  # (mb 1 with gen-config's prefetch: 0.32 samples/s on 2026-12-02; the mb 4 pair is the same-call comparison)
  timeout 340 python3 benchmarks/capped_runs.py --set lora24 --cases z3-param-offload-mb4,z3-param-offload-mb4-pf,z3-param-offload-pf \
     --timeout 110 --memory-cap-gib 23.6 --workdir $R/cw --out $R/capped_prefetch.jsonl > $R/capped_s.log 2>&1
  tail -6 $R/capped_s.log; rm -rf $R/cw
  timeout 165 python3 benchmarks/sample_speed.py --rows diffusers,fluxzero-compile --runs 2 --budget-s 150 \
     --out $R/sample_compile.jsonl > $R/sample_s.log 2>&1; tail -5 $R/sample_s.log
  ;;
esac
tar czf $OUTDIR/results_$1.tgz -C $R .
