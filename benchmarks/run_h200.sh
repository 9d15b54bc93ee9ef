#!/bin/bash
# One GPU call that checks and times the Pallas kernels and runs the next piece of the recall grids
# (device minutes are scarce: run this, not the pieces). Writes every output under $OUT (or
# ./gpu_run when unset) and prints the tables last. A device call is limited to 600 s: pick the
# steps (STEPS, run in order) and their limits to fit.
#
#   bash benchmarks/run_h200.sh                 # check_gpu, the five bench shapes, float32 train steps
#   STEPS="check stages" CHECK_ARGS="--configs defaults save_states=True --dtypes bfloat16" bash benchmarks/run_h200.sh
#   SWEEP_GPUS=1,2,3 STEPS="zoology check ncu" bash benchmarks/run_h200.sh      # nvidia-h200-x4
#
# Steps (LIMIT_<STEP> seconds bounds each, so that a slow one cannot eat the others'):
#   check      benchmarks/check_gpu.py, the suite's float64 cases on the GPU (CHECK_ARGS adds flags)
#   check2     a second check_gpu.py run (CHECK2_ARGS, LIMIT_CHECK2; output check_gpu2.txt)
#   bench_a/_b benchmarks/bench_pallas.py, shapes 0-2 / 3-4 with FLA and jax-linear-attention live
#              (bench = both; BENCH_SHAPES_A / _B replace the shapes, BENCH_FLAGS adds flags, e.g.
#              BENCH_SHAPES_A=0 BENCH_FLAGS=--no-chunk: one shape in ~2 min); LIMIT_BENCH
#   breakdown  each kernel alone (bench_pallas' per-kernel breakdown) at BREAKDOWN_SHAPES (default 0),
#              BREAKDOWN_FLAGS adds flags: e.g. BREAKDOWN_SHAPES=4 BREAKDOWN_FLAGS="--variants bwd_chunk=64"
#              (the D = 256 backward, all Triton: which of its kernels to replace first)
#   stages     benchmarks/bench_hopper_stages.py, each Hopper kernel alone with its HBM floor
#              (STAGES_ARGS replaces its flags, e.g. "--shapes 0 --only kernel,WG,pallas,jla";
#              STAGES_ONLY adds --only with spaces kept, e.g. "fwd WY approx,late o,pallas")
#   ab         bench_hopper_stages.py (STAGES_ARGS) once per source tree in AB_TREES (default ". .base/old":
#              the working tree and a copy of another commit's gdn_jax/ and benchmarks/, e.g. `rm -rf
#              .base/old && mkdir -p .base/old && git archive HEAD~1 gdn_jax benchmarks | tar x -C
#              .base/old` (rm first: a stale copy's extra files shadow the commit's), carried in
#              .base; a tree's own benchmarks/ run when it has them), each tree's gdn_jax
#              first on the path, with ptxas' register / spill lines of its kernels (A/B of a kernel
#              change in one call; LIMIT_AB bounds each tree's run). AB_BENCH runs another benchmark
#              per tree instead, e.g. AB_BENCH="bench_train_step.py --mixers mamba2 gla --d_models 64"
#   regs       ptxas' register / spill / shared-memory report of every Hopper kernel
#   ncu        Nsight Compute's speed-of-light, occupancy, warp-state, scheduler sections and the
#              per-reason stall ratios for each Hopper kernel run once (NCU_ARGS: bench_hopper_stages
#              flags; only kernels whose name matches NCU_KERNELS, default regex:mosaic -- XLA's
#              fusions and autotuning kernels used all 60 launches of the first run; NCU_LAUNCHES caps
#              them, default 12, the stages' preparation kernels included; needs a runtime that gives
#              ncu the counters, KINDS.md: Firecracker does)
#   decode     benchmarks/bench_decode.py --check (the full table: ~330 s on one H100; DECODE_ARGS adds flags)
#   dtests     the decode test files on the GPU (tests/models/test_fused_decode.py,
#              tests/ops/test_decode_layer_kernel.py; pytest, ~2-4 min; output decode_tests.txt)
#   dlayer     benchmarks/bench_decode_layer.py, the fused decode-layer kernel alone per program shape
#              (num_warps x bv) at batch 1 and 64 against its byte floor (DLAYER_ARGS adds flags)
#   cp         benchmarks/bench_context_parallel.py, the context path's overhead on one GPU (CP_ARGS adds
#              flags, e.g. "--shapes 0"), with o / S / grads against the plain op
#   split      benchmarks/bench_seq_split.py, the one-device sequence split against the unsplit op
#              (SPLIT_ARGS adds flags, e.g. "--shapes 1x16384x16x128 --pieces 2,4,auto")
#   loop       benchmarks/bench_loop.py, the training loop against its step
#   profile    the MQAR training step's top device kernels (bench_train_step.py --profile;
#              PROFILE_ARGS replaces its mixers / widths, e.g. "--mixers gla mamba2 --d_models 128")
#   knock      benchmarks/bench_knockouts.py (KNOCK_ARGS, default "--kernel state": the forward state
#              pass with parts of its chunk step removed, each timed; several runs separated by ';')
#   gla        benchmarks/bench_gla_gram.py, the GLA chunk form's decay Gram: library vs fused variant
#              (GLA_ARGS adds its flags, e.g. "--shape 128x512x2x32 --subs 8 4": other sub-block sizes)
#   fillers    experiments/attention_fillers.py (FILLERS_ARGS adds its flags); json + png come back
#   train      bench_train_step.py, float32 gdn / deltanet steps with backend auto (TRAIN_ARGS replaces
#              the mixers / widths, e.g. "--mixers gdn attention --d_models 64 --population 1 2 4")
#   zoology / fig2  the next piece of a Zoology grid, `experiments/sweep.py --preset
#              zoology_mqar|zoology_fig2` with a time budget of LIMIT_SWEEP - 60 s (LIMIT_SWEEP=none: no
#              limit, the runs bounded by their steps / epochs only), resuming from
#              results/<name> and .base/ckpt_<name> in the working tree
#   pub_gla / pub_mamba2 / pub_attention  the same for the published-variant baselines at the
#              zoology_mqar protocol (docs/baselines.md; results/zoology_{gla,mamba2}_published,
#              results/zoology_attention_zoo)
#   sweep:<preset>  the same for any preset (results/<preset>), e.g. sweep:zoology_gla_noconv
#              (its own flags: SWEEP_ARGS_sweep_<preset>, the step name with ':' as '_')
#              Every sweep step's results, log and unfinished runs' checkpoints come back as
#              $OUT/sweeps.tgz.part-*: `python benchmarks/unpack_sweeps.py <files_at>` merges them into
#              results/ and .base/ (carry .base next call), then commit results/. SWEEP_ARGS adds
#              sweep flags to every sweep step, SWEEP_ARGS_<step> to one (replacing SWEEP_ARGS), e.g.
#              SWEEP_ARGS_zoology="--mixers gla --d_models 64 --workers_per_device 2". With
#              SWEEP_GPUS (e.g. 1,2,3) they run in the background on those GPUs, one after the
#              other (SWEEP_CONCURRENT=1: all at once), while the other steps run on KERNEL_GPU
#              (default 0); SWEEP_MPS=1 runs them under CUDA MPS (see below). The checkpoints that come back are capped at CKPT_MB (default 45) MB
#              over all sweeps, the runs furthest along first.
#
# Wheels of the black-box comparisons (jax-linear-attention, fla-core) are installed from
# $WHEELS (default .base/wheels) when present.
set -o pipefail
OUT=${OUT:-gpu_run}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.base/wheels}
STEPS=${STEPS:-"check bench train"}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/ext "$WHEELS"/*.whl 2>/dev/null && export PYTHONPATH=/tmp/ext:${PYTHONPATH}
fi
export PYTHONPATH=.:${PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
# (the device's copy of .git can be stale: the working tree is what runs; record the commit by hand)
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"
sweep_spec() {  # sweep step -> its preset (= its results folder; the published variants: docs/baselines.md)
  case $1 in
    zoology) echo zoology_mqar ;;
    fig2) echo zoology_fig2 ;;
    pub_gla) echo zoology_gla_published ;;
    pub_mamba2) echo zoology_mamba2_published ;;
    pub_attention) echo zoology_attention_zoo ;;
    sweep:*) echo "${1#sweep:}" ;;  # any preset of gdn_jax/sweep.py, e.g. sweep:zoology_gla_noconv
  esac
}
SWEEP_STEPS="zoology fig2 pub_gla pub_mamba2 pub_attention"
sweep_step() {  # $1 = a sweep step: the next piece of that Zoology grid (see the header)
  local name args_var
  name=$(sweep_spec "$1")
  args_var="SWEEP_ARGS_${1//[^A-Za-z0-9_]/_}"; args_var=${!args_var-${SWEEP_ARGS:-}}
  # results (and unfinished runs' checkpoints) collect under /tmp; bundle_sweeps sends them back
  rm -rf "/tmp/$name" "/tmp/ckpt_$name"; mkdir -p "/tmp/ckpt_$name" /tmp/sweep_logs
  [ -d "results/$name" ] && cp -r "results/$name" "/tmp/$name"
  # checkpoints of unfinished runs: .base/ckpt_<name> (carried), else results/resume/ckpt_<name> (committed at
  # the end of a session whose runs were in flight: a new checkout has no .base)
  if [ -d ".base/ckpt_$name" ]; then cp -r ".base/ckpt_$name/." "/tmp/ckpt_$name/"
  elif [ -d "results/resume/ckpt_$name" ]; then cp -r "results/resume/ckpt_$name/." "/tmp/ckpt_$name/"; fi
  # a machine still warm from the previous call kept every checkpoint of its runs in flight, also those
  # bundle_sweeps dropped (over CKPT_MB): laid over the carried ones, a run resumes from its newest step
  if [ -d "/tmp/keep_ckpt_$name" ]; then cp -r "/tmp/keep_ckpt_$name/." "/tmp/ckpt_$name/"; echo "kept checkpoints of $name reused"; fi
  # SWEEP_ARGS_<step> (else SWEEP_ARGS): extra sweep flags, e.g. "--d_models 64 --workers_per_device 2"
  # LIMIT_SWEEP=none: no wall-clock limit and no time budget (the sweep ends when its runs end:
  # bounded by their steps / epochs; the CPU round-trip test, whose result must not depend on speed)
  local limit=() budget=()
  if [ "${LIMIT_SWEEP:-540}" != none ]; then
    limit=(timeout "${LIMIT_SWEEP:-540}"); budget=(--time_budget_s $(( ${LIMIT_SWEEP:-540} - 60 )))
  fi
  JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache "${limit[@]}" python experiments/sweep.py \
    --preset $name --out "/tmp/$name" --ckpt_root "/tmp/ckpt_$name" --no-progress \
    "${budget[@]}" $args_var \
    2>&1 | grep -v -i warning > "/tmp/sweep_logs/$name.txt"
  echo "--- sweep $1 ($name)"; tail -8 "/tmp/sweep_logs/$name.txt"
  # keep only the checkpoints of runs without a results.json (finished runs need none); a started rate
  # of a cell where another rate reached the target keeps its checkpoint: the sweep resumes and
  # finishes it (--lrs_in_parallel runs rates side by side; rates never started are skipped)
  (cd "/tmp/ckpt_$name" && for d in */lr*; do [ -f "/tmp/$name/runs/$d/results.json" ] && rm -rf "$d"
   done; true) 2>/dev/null
  echo "$name" >> /tmp/sweep_logs/names
}
bundle_sweeps() {  # every sweep's results folder, log and checkpoints -> $OUT/sweeps.tgz.part-*
  [ -f /tmp/sweep_logs/names ] || return 0
  local names n; names=$(sort -u /tmp/sweep_logs/names)
  # every checkpoint stays on this machine for a next call while it is warm (see sweep_step)
  for n in $names; do rm -rf "/tmp/keep_ckpt_$n"; [ -d "/tmp/ckpt_$n" ] && cp -r "/tmp/ckpt_$n" "/tmp/keep_ckpt_$n"; done
  # 64 MiB come back in all (and travel out again in .base): keep the checkpoints of the runs
  # furthest along up to CKPT_MB (default 45) MB over all sweeps, drop the rest (those restart)
  python - "${CKPT_MB:-45}" $names <<'PYEOF'
import os, shutil, sys
budget = float(sys.argv[1]) * 1e6
runs = []
for name in sys.argv[2:]:
    root = f"/tmp/ckpt_{name}"
    for cell in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for lr in sorted(os.listdir(os.path.join(root, cell))):
            d = os.path.join(root, cell, lr)
            steps = max([int(s) for s in os.listdir(d) if s.isdigit()] or [0])
            size = sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)
            runs.append((steps, size, d))
used = 0
for steps, size, d in sorted(runs, reverse=True):
    if used + size > budget:
        print(f"checkpoint dropped (over {budget / 1e6:.0f} MB): {d} at step {steps}")
        shutil.rmtree(d)
    else:
        used += size
PYEOF
  # a file comes back only under 16 MiB (64 MiB and 8 files in all): one archive in 15 MB parts;
  # here: python benchmarks/unpack_sweeps.py <files_at> (merges the runs into results/<name>/,
  # the checkpoints into .base/ckpt_<name>/, and rewrites each summary)
  tar czf - -C /tmp sweep_logs $(for n in $names; do echo "$n ckpt_$n"; done) \
    | split -b 15000000 - "$OUT/sweeps.tgz.part-"; ls -la "$OUT"/sweeps.tgz.part-*
}
# SWEEP_GPUS (e.g. "1,2,3" on nvidia-h200-x4): the sweep steps run in the background on
# those GPUs (the sweep spreads its workers over them) while the other steps run on KERNEL_GPU
# (default 0) -- a multi-GPU machine costs the same device time per minute as one GPU
# (several sweep steps run one after the other there, as without SWEEP_GPUS, unless SWEEP_CONCURRENT
# is set: then all at once, each worker with XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.15) of a GPU --
# more than six workers in all need it lower, e.g. 0.12 for seven: XLA preallocates that share;
# without SWEEP_GPUS the other steps then share the GPU with them)
# SWEEP_MPS=1: run the concurrent sweep workers under CUDA MPS (one daemon for this call, stopped at
# the end), so that several small runs' kernels share the GPU at once instead of time-slicing; if a
# CUDA client cannot start under it, the daemon is stopped and the workers run without it
if [ -n "${SWEEP_MPS:-}" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  if nvidia-cuda-mps-control -d && JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 \
       python -c "import jax.numpy as jnp; print('MPS client ok:', float(jnp.ones(4).sum()))"; then
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
  else
    echo "MPS unavailable: the workers run without it"; echo quit | nvidia-cuda-mps-control 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
bg=""
sweeps=$(for s in $STEPS; do case " $SWEEP_STEPS " in *" $s "*) echo $s ;; *) case $s in sweep:*) echo $s ;; esac ;; esac; done)
launch_sweeps() {  # the sweep steps in the background (SWEEP_GPUS or SWEEP_CONCURRENT), pid in $bg
  (
    [ -n "${SWEEP_GPUS:-}" ] && export CUDA_VISIBLE_DEVICES=$SWEEP_GPUS
    if [ -n "${SWEEP_CONCURRENT:-}" ]; then
      # every sweep step at once on the same GPUs: each worker its share of the memory
      export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.15}
      for s in $sweeps; do sweep_step $s & done; wait
    else
      for s in $sweeps; do sweep_step $s; done
    fi
  ) & bg=$!
  [ -n "${SWEEP_GPUS:-}" ] && export CUDA_VISIBLE_DEVICES=${KERNEL_GPU:-0}
}
# SWEEP_AFTER=1 (with SWEEP_CONCURRENT, no SWEEP_GPUS): the other steps run first, alone on the GPU
# (a benchmark timed beside the sweeps' workers is not a measurement), then the sweeps start
bg_sweeps=""
if [ -n "$sweeps" ] && { [ -n "${SWEEP_GPUS:-}" ] || [ -n "${SWEEP_CONCURRENT:-}" ]; }; then
  bg_sweeps=1
  if [ -z "${SWEEP_AFTER:-}" ] || [ -n "${SWEEP_GPUS:-}" ]; then launch_sweeps; fi
fi
for s in $STEPS; do
  case $s in
    check) timeout "${LIMIT_CHECK:-240}" python benchmarks/check_gpu.py ${CHECK_ARGS:-} 2>&1 | grep -v -i warning | tee "$OUT/check_gpu.txt" | tail -3 ;;
    check2) timeout "${LIMIT_CHECK2:-240}" python benchmarks/check_gpu.py ${CHECK2_ARGS:-} 2>&1 | grep -v -i warning | tee "$OUT/check_gpu2.txt" | tail -3 ;;
    bench|bench_a) timeout "${LIMIT_BENCH:-330}" python benchmarks/bench_pallas.py --shapes ${BENCH_SHAPES_A:-0,1,2} --reps 20 --no-breakdown ${BENCH_FLAGS:-} \
             2>&1 | grep -v -i warning | tee "$OUT/bench_pallas_a.txt" | tail -3 ;;&
    bench|bench_b) timeout "${LIMIT_BENCH:-330}" python benchmarks/bench_pallas.py --shapes ${BENCH_SHAPES_B:-3,4} --reps 20 --no-breakdown ${BENCH_FLAGS:-} \
             2>&1 | grep -v -i warning | tee "$OUT/bench_pallas_b.txt" | tail -3 ;;&
    breakdown) timeout "${LIMIT_BREAKDOWN:-200}" python benchmarks/bench_pallas.py --shapes ${BREAKDOWN_SHAPES:-0} --reps 20 \
             --no-fla --no-jla --no-chunk ${BREAKDOWN_FLAGS:-} 2>&1 | grep -v -i warning | tee "$OUT/breakdown.txt" | tail -3 ;;
    stages) timeout "${LIMIT_STAGES:-240}" python benchmarks/bench_hopper_stages.py ${STAGES_ARGS:---shapes 0,3,2 --reps 20} \
             ${STAGES_ONLY:+--only "$STAGES_ONLY"} 2>&1 | grep -v -i warning | tee "$OUT/stages.txt" | tail -3 ;;
    decode) timeout "${LIMIT_DECODE:-420}" python benchmarks/bench_decode.py --check --max_seconds "$(( ${LIMIT_DECODE:-420} - 60 ))" \
             --out "$OUT/decode" ${DECODE_ARGS:-} 2>&1 | grep -v -i warning | tee "$OUT/decode.txt" | tail -3 ;;
    dtests) timeout "${LIMIT_DTESTS:-300}" python -m pytest -q -p no:cacheprovider tests/models/test_fused_decode.py \
             tests/ops/test_decode_layer_kernel.py 2>&1 | grep -v -i warning | tee "$OUT/decode_tests.txt" | tail -5 ;;
    dlayer) timeout "${LIMIT_DLAYER:-150}" python benchmarks/bench_decode_layer.py --out "$OUT/decode_layer" ${DLAYER_ARGS:-} \
             2>&1 | grep -v -i warning | tee "$OUT/decode_layer.txt" | tail -22 ;;
    cp) timeout "${LIMIT_CP:-270}" python benchmarks/bench_context_parallel.py --out "$OUT/cp" ${CP_ARGS:-} \
             2>&1 | grep -v -i warning | tee "$OUT/context_parallel.txt" | tail -12 ;;
    split) timeout "${LIMIT_SPLIT:-240}" python benchmarks/bench_seq_split.py --budget "$(( ${LIMIT_SPLIT:-240} - 60 ))" \
             ${SPLIT_ARGS:-} 2>&1 | grep -v -i warning | tee "$OUT/seq_split.txt" | tail -12 ;;
    ab) for tree in ${AB_TREES:-. .base/old}; do
          echo "=== tree $tree" | tee -a "$OUT/ab.txt"
          # the benchmarks put their checkout's root first on sys.path: each tree runs from a copy
          # of its own benchmarks/ when it has one (an older tree's may not import this one's: e.g.
          # bench_pallas' FLAT_NAMES), else of this checkout's, beside that tree's gdn_jax/
          rm -rf /tmp/ab_tree && mkdir -p /tmp/ab_tree && cp -r "$tree/gdn_jax" /tmp/ab_tree/
          if [ -d "$tree/benchmarks" ]; then cp -r "$tree/benchmarks" /tmp/ab_tree/; else cp -r benchmarks /tmp/ab_tree/; fi
          if [ -n "${AB_BENCH:-}" ]; then  # another benchmark than the Hopper stages, e.g. the train step
            (cd /tmp/ab_tree && timeout "${LIMIT_AB:-200}" python benchmarks/$AB_BENCH 2>&1 | grep -v -i warning) \
              | tee -a "$OUT/ab.txt" | tail -12; continue
          fi
          (cd /tmp/ab_tree && MOSAIC_GPU_DUMP_PTXAS=1 timeout "${LIMIT_AB:-200}" python \
             benchmarks/bench_hopper_stages.py ${STAGES_ARGS:---shapes 0 --reps 20 --no-jla} \
             ${STAGES_ONLY:+--only "$STAGES_ONLY"} 2>&1 \
             | grep -v -i warning | grep -i -E "registers|spill stores|^ *[a-z(=]" | grep -v "Compile time") \
             | tee -a "$OUT/ab.txt" | grep -v -i -E "registers|spill" | tail -12
        done ;;
    regs) # ptxas' register / spill / shared-memory report of every Hopper kernel (MOSAIC_GPU_DUMP_PTXAS
          # is read by jaxlib's Mosaic GPU compiler; found in the JAX 0.10.2 CUDA plugin's strings)
          MOSAIC_GPU_DUMP_PTXAS=1 timeout "${LIMIT_REGS:-150}" python benchmarks/bench_hopper_stages.py --shapes 0 \
             --reps 2 --no-jla 2>&1 | grep -i -E "registers|spill|smem|Compiling entry|^ *(fwd|bwd)" \
             | tee "$OUT/regs.txt" | tail -40 ;;
    loop) timeout "${LIMIT_LOOP:-250}" python benchmarks/bench_loop.py --trace 200 \
             2>&1 | grep -v -i warning | tee "$OUT/bench_loop.txt" | tail -3 ;;
    zoology|fig2|pub_gla|pub_mamba2|pub_attention|sweep:*) [ -z "$bg_sweeps" ] && sweep_step $s ;;
    profile) # the MQAR training step's top device kernels (jax.profiler), gdn and attention at d 128
          timeout "${LIMIT_PROFILE:-120}" python benchmarks/bench_train_step.py ${PROFILE_ARGS:---mixers gdn attention --d_models 128} \
             --reps 20 --profile 10 2>&1 | grep -v -i warning | tee "$OUT/profile_step.txt" | tail -40 ;;
    ncu) # Nsight Compute on each Hopper kernel, run once (speed of light, occupancy, warp stall
         # reasons): works where the machine's runtime gives ncu the counters (KINDS.md: Firecracker)
         # (no preallocation: ncu saves and restores the device memory a replayed kernel may touch)
         XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${LIMIT_NCU:-240}" ncu --clock-control none \
             --kernel-name "${NCU_KERNELS:-regex:mosaic}" --launch-count "${NCU_LAUNCHES:-12}" \
             --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
             --section SchedulerStats --metrics "regex:smsp__average_warps_issue_stalled_.+_per_issue_active\.ratio" python \
             benchmarks/bench_hopper_stages.py --once --no-jla ${NCU_ARGS:---shapes 0 --only WY,pass,kernel} \
             2>&1 | grep -v -i warning > "$OUT/ncu.txt"; tail -5 "$OUT/ncu.txt" ;;
    fillers) # issue #16's attention experiment: attention mass on the 0 fillers over training
         # (FILLERS_ARGS: its flags, e.g. "--lengths 512 --key_bias none k"); json + png come back
         timeout "${LIMIT_FILLERS:-400}" python experiments/attention_fillers.py --out "$OUT/attention_fillers" \
             ${FILLERS_ARGS:-} 2>&1 | grep -v -i warning | tee "$OUT/attention_fillers.txt" | tail -5 ;;
    knock) # benchmarks/bench_knockouts.py: a Hopper kernel with parts removed, each variant timed
          # (KNOCK_ARGS: one run's flags, or several runs' separated by ';', e.g. "--kernel state
          # --shape 1x16384x16x128; --kernel grads"; kernels wy, grads, state); LIMIT_KNOCK bounds all
          IFS=';' read -ra knock_runs <<< "${KNOCK_ARGS:---kernel state}"
          timeout "${LIMIT_KNOCK:-200}" bash -c 'for a in "$@"; do python benchmarks/bench_knockouts.py $a; done' _ \
             "${knock_runs[@]}" 2>&1 | grep -v -i warning | tee "$OUT/knockouts.txt" | tail -3 ;;
    gla) timeout "${LIMIT_GLA:-90}" python benchmarks/bench_gla_gram.py ${GLA_ARGS:-} 2>&1 | grep -v -i warning | tee "$OUT/gla_gram.txt" | tail -6 ;;
    train) timeout "${LIMIT_TRAIN:-120}" python benchmarks/bench_train_step.py ${TRAIN_ARGS:---mixers gdn deltanet --d_models 128 256} \
             --backend auto --reps 10 2>&1 | grep -v -i warning | tee "$OUT/train_auto.txt" | tail -3 ;;
  esac
done
[ -n "$bg_sweeps" ] && [ -z "$bg" ] && launch_sweeps
[ -n "$bg" ] && wait $bg
bundle_sweeps
echo "=== tables"
for f in ab check_gpu bench_pallas_a bench_pallas_b breakdown stages knockouts train_auto bench_loop regs profile_step; do
  [ -f "$OUT/$f.txt" ] && { echo "--- $f"; if [ $f = stages ] || [ $f = ab ] || [ $f = regs ] || [ $f = profile_step ] || [ $f = knockouts ]; then tail -60 "$OUT/$f.txt"; else
    sed -n '/within the suite\|SUMMARY\|^mixer/,$p' "$OUT/$f.txt" | head -40; fi; }
done
true  # the script's status is not its last table's test
