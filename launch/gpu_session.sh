#!/usr/bin/env bash
# Runs the GPU benchmarks on a lent machine that has JAX but not this package or jax-triton
# (the device tool's machines). Usage: bash launch/gpu_session.sh SUITE [SUITE...]
#   mfu    1 GPU: llama_1b tokens/s and MFU, colocated, 32K and 64K tokens per device
#   cad    all GPUs: colocated vs distca (ping-pong on/off), llama3_8b shape with 2 layers
#          (env CAD_BATCHES, CAD_TOKENS, CAD_ABLATION: the batch with the single-stream ablation,
#          CAD_RESEND: the batch that also runs memory_mode=resend (temp memory per mode),
#          CAD_RAGGED: the batch that also runs attention.exchange=ragged, CAD_UNGATED: batches
#          that also run distca with attention.min_imbalance=1 (balancing however small the gain),
#          CAD_SHIFTED: batches that also run attention.exchange=shifted,
#          CAD_TRACE: where to trace the first batch's distca step, "" for no trace, CAD_EXTRA:
#          more key=value overrides, e.g. data.elongate_factor=2; a batch "prolong@N" is the
#          sampler's batch of step N; the ablations run CAD on every batch, min_imbalance=1)
#   kernels 1 GPU: the kernel tests in bf16 (K_TESTS, a pytest -k filter; none: skip), then
#          launch/bench_kernels.py with K_ARGS (none: skip); logs append, so it can run repeatedly
#   mgpu   1 GPU: launch/probe_mgpu.py (JAX's Mosaic GPU attention vs cuDNN vs ours, non-causal)
#   ncu    1 GPU: Nsight Compute (full set, clocks left alone) on one launch of the dense one-kernel
#          backward (fused_bwd) and of the task-table one (ca_tasks_bwd) on the probe's batch, and of
#          each mosaic:KEY=VALUE variant in N_VARIANTS; reports, details and per-SASS-line counters to $OUT
#   ncub   1 GPU: Nsight Compute (launch, occupancy, warp-state, memory and SM-activity sections) on
#          the first N_KERNEL (default ca_tasks_bwd) launch of each of bench_kernels.py's N_BACKENDS
#          (mosaic) on each batch of N_BATCHES (prolong pretrain) at N_CTX (65536) tokens: text
#          reports to $OUT, the key lines printed; N_METRICS: more metrics, N_EXTRA: more ncu options
#   ncuside 1 GPU: Nsight Compute (stall reasons, SASS counters) on the mosaic backward and on
#          cuDNN's dense backward of equal causal area, on the first batch of N_BATCHES at N_CTX
#   ktrace 1 GPU: launch/ab_mosaic.py --trace on T_DATASETS (prolong) at each of T_CONTEXTS (65536
#          131072) for T_VERSIONS (now=): f+b TF/s and the GPU time per call of every kernel a
#          forward+backward runs (the attention kernels and the XLA passes around them)
#   kdump  1 GPU: one round of launch/ab_mosaic.py on Pretrain 64K (D_VERSIONS, default "now=")
#          with Mosaic GPU's dumps on: each kernel's ptxas report (registers, spills) printed, its
#          PTX to $OUT/ptx (assemble and read it on any machine: ptxas -arch=sm_90a -o k.cubin
#          k.ptx; cuobjdump -sass k.cubin, cuobjdump from the nvidia-cuda-cuobjdump wheel)
#   kstep  1 GPU: one training step per attention kernel in S_KERNELS (default "triton mosaic"),
#          each its own process on the same machine, S_MODEL overrides (default llama3_8b with 2
#          layers), S_TOKENS tokens (default 65536) sampled from S_DIST (default prolong: on a
#          Pretrain 64K batch attention is ~3% of this step, too little for a kernel to show):
#          step time, peak and XLA temp memory per kernel; S_TIMEOUT a process (default 200 s;
#          16 layers took ~150 s with Llama-3-8B's shape: give it 300)
#   kcompile 1 GPU: launch/compile_profile.py per attention kernel in C_KERNELS (default "triton
#          mosaic") and layer count in C_LAYERS (default "2 6"), each its own process, C_MODEL
#          overrides (default model.preset=llama3_8b), C_TOKENS (65536) ProLong tokens: lowering, XLA compile and first-run seconds, and
#          the compile's host trace summed by event name (XLA's passes by name)
#   kfit   1 GPU: launch/train.py colocated for F_STEPS (40) sampled steps of F_DIST (prolong) per
#          attention kernel in F_KERNELS (default "triton mosaic"), Llama-3-8B shape with 2 layers,
#          64K tokens: per-step logs in $OUT/kfit_<kernel>.log, then launch/fit_gate.py
#          --kernel-logs on them (each kernel's attention time per FLOP in training steps; F_TIMEOUT)
#   train  all GPUs: launch/train.py with distca for a few steps (compile count, host wait)
#   pp     all GPUs as pipeline stages: colocated vs distca attention in the lock-step pipeline,
#          llama3_8b shape with 4 layers, 4 micro-batches of 64K tokens, skewed and Pretrain
#          (env PP_TOKENS, PP_LAYERS, PP_BATCHES, PP_MICROBATCHES, PP_TIMEOUT; PP_TRACE=DIR traces
#          every variant's last step and prints its per-phase busy time)
#   cadmem the cad suite compiled only (CAD_* as for cad; default: prolong with the ragged exchange),
#          with XLA's buffer assignment of each variant's step and its ragged all-to-alls
#   ppmem  the pp suite compiled only, with XLA's buffer assignment of each variant's step
#   ragged all GPUs: tiled vs ragged exchange on one batch (R_BATCH, R_TOKENS), once per XLA
#          ragged-all-to-all implementation (NCCL, one-shot kernel), each process under R_TIMEOUT
#   tests  all GPUs: pytest T_FILES (default tests/test_dispatch.py) -k T_K (default ragged)
#   uniform128  all GPUs: colocated vs distca on the uniform batch at 128K tokens per device
#   gaterun  all GPUs: launch/train.py for G_STEPS (24) sampled steps of G_DIST (pretrain), once
#          colocated and once distca with its gate, G_TOKENS (65536) per device; per-step logs in
#          $OUT/gaterun_<impl>.log, compared step by step by launch/gate_report.py; G_EXTRA: more
#          overrides for both runs (e.g. data.elongate_factor=2); learning rate 3e-4 (runs until
#          2026-11-27 used the default 3e-3, whose loss spikes parted the two runs' losses early)
# Logs and tables go to $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# The package as an installed wheel would lay it out: models/ and kernels/ inside distca_jax.
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r distca_jax /tmp/pkg/ && cp -r kernels /tmp/pkg/distca_jax/kernels \
  && cp -r models /tmp/pkg/distca_jax/models
export PYTHONPATH=/tmp/pkg:/tmp/site:${PYTHONPATH:-}
CAD_TRACE=${CAD_TRACE-/tmp/trace}  # "" for no trace
# Nsight Compute sections of the ncub and ncuside suites (ncuside adds its own).
NCU_SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
  --section SchedulerStats --section MemoryWorkloadAnalysis"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpus.txt"
for suite in "$@"; do
  case $suite in
    mfu) CUDA_VISIBLE_DEVICES=0 timeout -k 10 230 python3 -P launch/bench_train.py --suite mfu --tokens 32768 65536 \
           --warmup 1 --steps 3 --json "$OUT/mfu.json" model.preset=llama_1b data.length_scale=1 2>&1 | grep -v -i warn | tee "$OUT/mfu.log" ;;
    cad) timeout -k 10 ${CAD_TIMEOUT:-330} python3 -P launch/bench_train.py --suite cad --warmup 1 --steps 3 --json "$OUT/cad.json" \
           --batches ${CAD_BATCHES:-pretrain prolong skewed uniform} --pingpong-ablation "${CAD_ABLATION-pretrain}" \
           --resend-ablation "${CAD_RESEND-skewed}" --ragged-ablation "${CAD_RAGGED-prolong}" \
           --ungated-ablation "${CAD_UNGATED-}" --shifted-ablation "${CAD_SHIFTED-}" ${CAD_TRACE:+--trace-dir $CAD_TRACE} model.preset=llama3_8b model.layers=2 data.tokens_per_device=${CAD_TOKENS:-65536} \
           data.length_scale=1 ${CAD_EXTRA:-} 2>&1 | grep -v -i warn | tee "$OUT/cad.log"
         if [ -n "$CAD_TRACE" ]; then
           find "$CAD_TRACE"/*-distca -name 'perfetto_trace.json.gz' -exec cp {} "$OUT/cad_trace.json.gz" \;
           python3 -P launch/tools/overlap_report.py "$OUT/cad_trace.json.gz" 2>&1 | tee "$OUT/overlap.log"
         fi ;;
    cadmem) XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/caddump --xla_dump_hlo_module_re=.*train_step.*" \
           timeout -k 10 ${CAD_TIMEOUT:-300} python3 -P launch/bench_train.py --suite cad --compile-only \
           --batches ${CAD_BATCHES:-prolong} --pingpong-ablation "${CAD_ABLATION-}" --resend-ablation "${CAD_RESEND-}" \
           --ragged-ablation "${CAD_RAGGED-prolong}" model.preset=llama3_8b model.layers=2 \
           data.tokens_per_device=${CAD_TOKENS:-65536} data.length_scale=1 ${CAD_EXTRA:-} 2>&1 \
           | grep -v -i warn | tee -a "$OUT/cadmem.log"
         python3 -P launch/tools/xla_buffers.py /tmp/caddump --top 20 2>&1 | tee -a "$OUT/cadmem.log"
         grep -h "ragged-all-to-all(" /tmp/caddump/*after_optimizations.txt | cut -c1-400 | head -20 | tee -a "$OUT/cadmem.log" ;;
    pp) timeout -k 10 ${PP_TIMEOUT:-420} python3 -P launch/bench_train.py --suite pp --batches ${PP_BATCHES:-skewed pretrain} \
           --microbatches ${PP_MICROBATCHES:-4} --warmup 1 --steps 2 --json "$OUT/pp.json" \
           ${PP_TRACE:+--trace-dir $PP_TRACE} model.preset=llama3_8b \
           model.layers=${PP_LAYERS:-4} data.tokens_per_device=${PP_TOKENS:-65536} data.length_scale=1 2>&1 \
           | grep -v -i warn | tee -a "$OUT/pp.log" ;;
    ppmem) XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/ppdump --xla_dump_hlo_module_re=.*train_step.*" \
           timeout -k 10 ${PP_TIMEOUT:-300} python3 -P launch/bench_train.py --suite pp --compile-only \
           --batches ${PP_BATCHES:-skewed} --microbatches ${PP_MICROBATCHES:-4} model.preset=llama3_8b \
           model.layers=${PP_LAYERS:-4} data.tokens_per_device=${PP_TOKENS:-65536} data.length_scale=1 2>&1 \
           | grep -v -i warn | tee -a "$OUT/ppmem.log"
         python3 -P launch/tools/xla_buffers.py /tmp/ppdump --top 25 2>&1 | tee -a "$OUT/ppmem.log" ;;
    kernels) export CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda
           [ "${K_TESTS:-}" = none ] || timeout -k 10 ${K_TEST_TIMEOUT:-240} python3 -P -m pytest -q -rf --tb=line --disable-warnings -p no:cacheprovider \
             tests/test_kernels.py -k "${K_TESTS:-bfloat16}" 2>&1 | grep -v Warning | tail -25 | tee -a "$OUT/kernel_tests.log"
           [ "${K_ARGS:-}" = none ] || timeout -k 10 ${K_TIMEOUT:-330} python3 -P launch/bench_kernels.py --out "$OUT" ${K_ARGS:-} 2>&1 | grep -v -i warn \
             | tee -a "$OUT/kernels.log"
           unset CUDA_VISIBLE_DEVICES JAX_PLATFORMS ;;
    mgpu) CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda timeout -k 10 ${M_TIMEOUT:-200} python3 -P launch/probe_mgpu.py ${M_ARGS:-} 2>&1 \
           | grep -v -i warn | tee -a "$OUT/mgpu.log" ;;
    kstep) for k in ${S_KERNELS:-triton mosaic}; do
             CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${S_TIMEOUT:-200} python3 -P launch/bench_train.py --suite mfu \
               --tokens ${S_TOKENS:-65536} --warmup 1 --steps 3 --json "$OUT/kstep_$k.json" \
               ${S_MODEL:-model.preset=llama3_8b model.layers=2} data.length_scale=1 \
               data.distribution=${S_DIST:-prolong} attention.kernel=$k 2>&1 \
               | grep -v -i warn | tail -3 | tee -a "$OUT/kstep.log"
           done ;;
    kcompile) for k in ${C_KERNELS:-triton mosaic}; do
             for l in ${C_LAYERS:-2 6}; do
               CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${C_TIMEOUT:-240} python3 -P launch/compile_profile.py \
                 --trace /tmp/ctrace_${k}_$l --top ${C_TOP:-40} ${C_MODEL:-model.preset=llama3_8b} model.layers=$l \
                 data.tokens_per_device=${C_TOKENS:-65536} data.length_scale=1 attention.kernel=$k 2>&1 \
                 | grep -v -i warn | tee -a "$OUT/kcompile.log"
             done
           done ;;
    ncu) export CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda
         profile() {  # label, kernel regex, probe args
           XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout -k 10 ${N_TIMEOUT:-150} ncu --clock-control none --set full --import-source no -k "regex:$2" -c 1 \
             -f -o "$OUT/ncu_$1" python3 -P launch/probe_mgpu.py --no-check $3 2>&1 | grep -v -i warn | tail -8 | tee -a "$OUT/ncu.log"
           ncu -i "$OUT/ncu_$1.ncu-rep" --page details > "$OUT/ncu_$1_details.txt" 2>&1
           ncu -i "$OUT/ncu_$1.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_$1_sass.csv" 2>&1
         }
         profile dense fused_bwd "--rows fused --fused-stages 2"
         profile tasks ca_tasks_bwd "--rows ours --backends mosaic"
         for v in ${N_VARIANTS:-}; do profile "tasks_$v" ca_tasks_bwd "--rows ours --backends mosaic:$v"; done
         (cd "$OUT" && tar czf ncu.tgz ncu_* && rm -f ncu_*)  # one file back (the tool caps the count)
         unset CUDA_VISIBLE_DEVICES JAX_PLATFORMS ;;
    ktrace) for ctx in ${T_CONTEXTS:-65536 131072}; do
             CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda timeout -k 10 ${T_TIMEOUT:-200} python3 -P launch/ab_mosaic.py \
               ${T_VERSIONS:-now=} --rounds ${T_ROUNDS:-3} --datasets ${T_DATASETS:-prolong} --context $ctx --trace 2>&1 \
               | grep -v -i warn | tee -a "$OUT/ktrace.log"
           done ;;
    kdump) rm -rf /tmp/mgpu_dump && mkdir -p /tmp/mgpu_dump "$OUT/ptx"
           CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda MOSAIC_GPU_DUMP_TO=/tmp/mgpu_dump timeout -k 10 ${D_TIMEOUT:-240} \
             python3 -P launch/ab_mosaic.py ${D_VERSIONS:-now=} --rounds 1 --datasets pretrain 2>&1 \
             | grep "TF/s" | tee -a "$OUT/kdump.log"
           for f in /tmp/mgpu_dump/*.ptxas; do echo "$(basename "$f" .ptxas): $(grep -h "spill stores" "$f")"; done \
             | tee -a "$OUT/kdump.log"
           cp /tmp/mgpu_dump/*.ptx "$OUT/ptx/" ;;
    ncub) for b in ${N_BATCHES:-prolong pretrain}; do
           for be in ${N_BACKENDS:-mosaic}; do
             f="$OUT/ncub_${b}_${be//[:=+]/_}.txt"
             CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda timeout -k 10 ${N_TIMEOUT:-150} ncu --clock-control none \
               $NCU_SECTIONS --metrics sm__cycles_active.avg,sm__cycles_elapsed.max,l1tex__t_sector_hit_rate.pct,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_hit.sum${N_METRICS:+,$N_METRICS} \
               ${N_EXTRA:-} -k "regex:${N_KERNEL:-ca_tasks_bwd}" -c 1 python3 -P launch/bench_kernels.py --backends $be \
               --datasets $b --contexts ${N_CTX:-65536} --sweep= --budget-s 60 > "$f" 2>&1
             echo "== $b $be"; grep -E "Duration|Shared Memory Configuration|Dynamic Shared|L1/TEX Hit|L2 Hit|hit_rate|local_op|Registers Per|stalled|Warp Cycles Per Issued" "$f" | cut -c1-120
           done
         done ;;
    ncuside) # Nsight Compute on the first backward launch of `mosaic` (ca_tasks_bwd) and of cuDNN's
           # dense causal attention of equal causal area (its bprop kernel) on the same benchmark
           # batch (N_BATCHES' first, N_CTX tokens): details pages and per-SASS-line counters, in
           # one archive. Named sections, XLA holding 60% of the memory: `--set full` with 92%
           # failed to profile either launch (H200; which of the two mattered is not known)
           export CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.6
           b=${N_BATCHES:-prolong}; b=${b%% *}
           for side in mosaic:ca_tasks_bwd dense:bprop; do
             be=${side%%:*}; [ "$be" = dense ] && be=""
             XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout -k 10 ${N_TIMEOUT:-200} ncu \
               --clock-control none --import-source no $NCU_SECTIONS --section ComputeWorkloadAnalysis \
               --section InstructionStats --section SourceCounters -k "regex:${side#*:}" -c 1 -f \
               -o "$OUT/ncu_${side%%:*}" python3 -P launch/bench_kernels.py --backends "$be" --datasets "$b" \
               --contexts ${N_CTX:-65536} --sweep= --budget-s 60 2>&1 | grep -v -i warn | tail -3
             ncu -i "$OUT/ncu_${side%%:*}.ncu-rep" --page details --print-details all > "$OUT/ncu_${side%%:*}_details.txt" 2>&1
             ncu -i "$OUT/ncu_${side%%:*}.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${side%%:*}_sass.csv" 2>&1
           done
           grep -E "^  [a-z_]+|Duration|Issue Slots Busy|Warp Cycles Per Issued" "$OUT"/ncu_*_details.txt | cut -c1-140
           for side in mosaic dense; do echo "== $side"; python3 -P launch/ncu_stalls.py "$OUT/ncu_${side}_sass.csv" --top 15; done
           (cd "$OUT" && tar czf ncuside.tgz ncu_* && rm -f ncu_*)
           unset CUDA_VISIBLE_DEVICES JAX_PLATFORMS; export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 ;;
    ragged) # The ragged exchange against tiled, once per XLA ragged-all-to-all implementation
           # (default NCCL path; the intra-node one-shot kernel), each in its own process so a
           # hang costs only its own R_TIMEOUT (SIGKILL 10 s later: a hung NCCL process that
           # ignores SIGTERM would hold the GPUs for the next command).
           for impl in nccl oneshot; do
             flags=""; [ $impl = oneshot ] && flags="--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true"
             mkdir -p "$OUT/ragged_$impl"
             XLA_FLAGS="${XLA_FLAGS:-} $flags" timeout -k 10 ${R_TIMEOUT:-240} python3 -P launch/bench_train.py --suite cad \
               --warmup 1 --steps 3 --json "$OUT/ragged_$impl/cad.json" --batches ${R_BATCH:-prolong} \
               --pingpong-ablation "" --ragged-ablation ${R_BATCH:-prolong} model.preset=llama3_8b model.layers=2 \
               data.tokens_per_device=${R_TOKENS:-65536} data.length_scale=1 2>&1 | grep -v -i warn \
               | sed "s/^/[$impl] /" | tee -a "$OUT/ragged.log"
           done ;;
    tests) JAX_PLATFORMS=cuda timeout -k 10 ${T_TIMEOUT:-240} python3 -P -m pytest -q -p no:cacheprovider ${T_FILES:-tests/test_dispatch.py} \
           -k "${T_K:-ragged}" 2>&1 | grep -v -i warn | tail -15 | tee -a "$OUT/tests.log" ;;
    uniform128) timeout -k 10 ${U_TIMEOUT:-150} python3 -P launch/bench_train.py --suite cad --batches uniform --pingpong-ablation uniform \
           --warmup 1 --steps 3 --json "$OUT/uniform128.json" model.preset=llama3_8b model.layers=2 \
           data.tokens_per_device=${U_TOKENS:-131072} data.length_scale=1 2>&1 | grep -v -i warn | tee -a "$OUT/uniform128.log" ;;
    kfit) logs=""
          for k in ${F_KERNELS:-triton mosaic}; do
            CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${F_TIMEOUT:-200} python3 -P launch/train.py model.preset=llama3_8b \
              model.layers=2 data.tokens_per_device=65536 data.length_scale=1 data.distribution=${F_DIST:-prolong} \
              mesh.data=1 attention.impl=colocated attention.kernel=$k train.steps=${F_STEPS:-40} \
              train.progress=false optim.lr=3e-4 train.tensorboard=false checkpoint.every=0 \
              train.out_dir=/tmp/kfit_$k 2>&1 | grep -v -i warn > "$OUT/kfit_$k.log"; tail -2 "$OUT/kfit_$k.log"
            logs="$logs $OUT/kfit_$k.log"
          done
          python3 -P launch/fit_gate.py --no-fit --kernel-logs $logs --set data.distribution=${F_DIST:-prolong} \
            2>&1 | tee "$OUT/kfit.md" ;;
    train) timeout -k 10 300 python3 -P launch/train.py model.preset=llama3_8b model.layers=2 data.tokens_per_device=65536 data.length_scale=1 \
           attention.impl=distca train.steps=8 train.progress=false train.out_dir=/tmp/run 2>&1 \
           | grep -v -i warn | tee "$OUT/train.log" ;;
    gaterun) n=$(nvidia-smi -L | wc -l)
           for impl in colocated distca; do  # the same sampled batches, one run per attention
             timeout -k 10 ${G_TIMEOUT:-280} python3 -P launch/train.py model.preset=llama3_8b model.layers=2 \
               data.tokens_per_device=${G_TOKENS:-65536} data.length_scale=1 data.distribution=${G_DIST:-pretrain} \
               mesh.data=$n attention.impl=$impl train.steps=${G_STEPS:-24} train.progress=false optim.lr=3e-4 \
               train.tensorboard=false checkpoint.every=0 train.out_dir="/tmp/gaterun_$impl" ${G_EXTRA:-} 2>&1 \
               | grep -v -i warn > "$OUT/gaterun_$impl.log"; tail -6 "$OUT/gaterun_$impl.log"
           done
           python3 -P launch/gate_report.py "$OUT/gaterun_colocated.log" "$OUT/gaterun_distca.log" \
             | tee "$OUT/gaterun.md" ;;
    *) echo "unknown suite $suite" ;;
  esac
done
