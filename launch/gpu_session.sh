#!/usr/bin/env bash
# The maintained GPU benchmarks, run on a machine that has JAX but not this package or
# jax-triton (a lent GPU host). Usage: bash launch/gpu_session.sh SUITE [SUITE...] (--help: this)
# Training steps (launch/bench_train.py, launch/train.py, launch/profile_steps.py):
#   mfu    1 GPU: llama_1b tokens/s and MFU, colocated, 32K and 64K tokens per device (MFU_TOKENS),
#          remat=full beside remat=auto; MFU_ARGS: more bench_train.py options (--remat POLICY...,
#          --mfu-8b-layers N, --loss-ablation, --trace-dir DIR), MFU_TIMEOUT (default 230 s)
#   cad    all GPUs: colocated vs distca (ping-pong on/off) and the WLB-LLM-style baseline
#          (data.packing=wlb, colocated attention), llama3_8b shape with 2 layers
#          (env CAD_BATCHES, CAD_TOKENS, CAD_WLB_CP: the baseline's CP group size, default auto,
#          "" for none, CAD_ABLATION: the batch with the single-stream ablation,
#          CAD_RESEND: the batch that also runs memory_mode=resend (temp memory per mode),
#          CAD_RAGGED: the batch that also runs attention.exchange=ragged, CAD_UNGATED: batches
#          that also run distca with attention.gate=false (balancing however small the gain),
#          CAD_TRACE: where to trace the first batch's distca step, "" for no trace (traced: the
#          communication beside compute, launch/tools/overlap_report.py), CAD_EXTRA: more
#          key=value overrides, e.g. data.elongate_factor=2; a batch "prolong@N" is the
#          sampler's batch of step N; the ablations run CAD on every batch, gate off)
#   overhead 1 GPU: colocated vs CAD with nothing to move (gate off; ping-pong and single-stream),
#          llama3_8b shape with O_LAYERS (2) layers, O_TOKENS ("65536") tokens, O_BATCHES
#          ("pretrain prolong uniform"): step ratios and each step part's GPU time side by side
#          (O_TIMEOUT, default 560 s; O_EXTRA: more overrides)
#   ppmem  1 GPU: the pp suite's variants compiled (not run) for a mocked cluster of M_STAGES (2)
#          GPUs as pipeline stages: XLA's GPU temporaries per device, ping-pong per tick against one
#          stream; llama3_8b with M_LAYERS (4) layers, M_MICROBATCHES (4) micro-batches of M_TOKENS
#          (65536) tokens, M_BATCHES (pretrain), remat full (M_TIMEOUT, default 400 s)
#   pp     all GPUs as pipeline stages: colocated vs distca attention in the lock-step pipeline,
#          llama3_8b shape with 4 layers, 4 micro-batches of 64K tokens, skewed and Pretrain
#          (env PP_TOKENS, PP_LAYERS, PP_BATCHES, PP_MICROBATCHES, PP_TIMEOUT; PP_TRACE=DIR traces
#          every variant's last step and prints its per-phase busy time)
#   ragged all GPUs: tiled vs ragged exchange on one batch (R_BATCH, default prolong; R_TOKENS),
#          once per XLA ragged-all-to-all implementation in R_IMPLS (default "nccl oneshot
#          device": NCCL send/recv, which waits on the host; the one-shot kernel, one node only;
#          the device-initiated kernel, which needs NCCL >= 2.29), each its own process under
#          R_TIMEOUT (default 240 s); prints the NCCL wheel's version first
#   kstep  1 GPU: one training step per attention kernel in S_KERNELS (default "triton mosaic"),
#          each its own process on the same machine, S_MODEL overrides (default llama3_8b with 2
#          layers), S_TOKENS tokens (default 65536) sampled from S_DIST (default prolong: on a
#          Pretrain 64K batch attention is ~3% of this step, too little for a kernel to show):
#          step time, peak and XLA temp memory per kernel; S_TIMEOUT a process (default 200 s;
#          give 16 layers of Llama-3-8B's shape 300)
#   train  all GPUs: launch/train.py with distca for 8 steps (compile count, host wait)
#   profile all GPUs: launch/profile_steps.py, distca (P_IMPL), llama3_8b shape with 2 layers,
#          P_TOKENS (65536) Pretrain tokens per device, P_EXTRA: more overrides: compile time, step
#          time, per-phase busy time; profile.json and attention_load.png to $OUT (P_TIMEOUT)
#   kcompile 1 GPU: launch/compile_profile.py per attention kernel in C_KERNELS (default "triton
#          mosaic") and layer count in C_LAYERS (default "2 6"), each its own process, C_MODEL
#          overrides (default model.preset=llama3_8b), C_TOKENS (65536) ProLong tokens: lowering,
#          XLA compile and first-run seconds, and the compile's host trace summed by event name
# The step gate (launch/fit_gate.py, launch/tools/gate_report.py):
#   gaterun all GPUs: launch/train.py for G_STEPS (24) sampled steps of G_DIST (pretrain), once
#          colocated and once distca with its gate, G_TOKENS (65536) per device; per-step logs in
#          $OUT/gaterun_<impl>.log, compared step by step by launch/tools/gate_report.py; G_EXTRA:
#          more overrides for both runs (e.g. data.elongate_factor=2); learning rate 3e-4 (the
#          default 3e-3's loss spikes part the two runs' losses early)
#   kfit   1 GPU: launch/train.py colocated for F_STEPS (40) sampled steps of F_DIST (prolong) per
#          attention kernel in F_KERNELS (default "triton mosaic"), Llama-3-8B shape with 2 layers,
#          64K tokens: per-step logs in $OUT/kfit_<kernel>.log, then launch/fit_gate.py
#          --kernel-logs on them (each kernel's attention time per FLOP in training steps; F_TIMEOUT)
# The exchange (launch/bench_exchange.py):
#   exchange 1 GPU: the CAD exchange compiled for mocked GPU clusters of X_DEVICES (default
#          "8 16 32 64") GPUs: XLA's GPU buffers per transport (ragged, tiled) over the
#          busiest device's moving rows, X_BATCHES (1) batches, X_TOKENS (65536) tokens per device,
#          X_TIMEOUT (240 s) a cluster size; X_STEP_LAYERS (2; 0: none): also whole training steps
#          of llama3_8b with that many layers, colocated and CAD per transport (temporaries)
# Checkpoint formats (launch/tools/hf_reference_check.py):
#   hf     1 GPU machine (on its CPU): the Hugging Face converter against transformers itself (the
#          machine's torch and transformers): import logits, the export reloaded by from_pretrained
# Kernels (launch/bench_kernels.py, launch/tools/ab_mosaic.py) and GPU-only tests:
#   kernels 1 GPU: the kernel tests in bf16 (K_TESTS, a pytest -k filter; none: skip), then
#          launch/bench_kernels.py with K_ARGS (none: skip); logs append, so it can run repeatedly
#   ktrace 1 GPU: launch/tools/ab_mosaic.py --trace on T_DATASETS (prolong) at each of T_CONTEXTS
#          (65536 131072) for T_VERSIONS (now=): f+b TF/s and the GPU time per call of every kernel
#          a forward+backward runs (the attention kernels and the XLA passes around them)
#   tests  all GPUs: pytest T_FILES (default tests/test_dispatch.py) -k T_K (default ragged: the
#          ragged exchange runs only on GPUs)
# Logs and tables go to $OUT (or ./gpu_out).
set -uo pipefail
if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,/^# Logs and tables/p' "$0" | cut -c3-; exit 0
fi
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
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpus.txt"
for suite in "$@"; do
  case $suite in
    mfu) CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${MFU_TIMEOUT:-230} python3 -P launch/bench_train.py --suite mfu \
           --tokens ${MFU_TOKENS:-32768 65536} --warmup 1 --steps 3 --json "$OUT/mfu.json" ${MFU_ARGS:-} \
           -- model.preset=llama_1b data.length_scale=1 2>&1 | grep -v -i warn | tee -a "$OUT/mfu.log" ;;
    cad) timeout -k 10 ${CAD_TIMEOUT:-330} python3 -P launch/bench_train.py --suite cad --warmup 1 --steps 3 --json "$OUT/cad.json" \
           --batches ${CAD_BATCHES:-pretrain prolong skewed uniform} --pingpong-ablation "${CAD_ABLATION-pretrain}" \
           --resend-ablation "${CAD_RESEND-skewed}" --ragged-ablation "${CAD_RAGGED-prolong}" \
           --ungated-ablation "${CAD_UNGATED-}" \
           --wlb-cp "${CAD_WLB_CP-auto}" ${CAD_TRACE:+--trace-dir $CAD_TRACE} model.preset=llama3_8b model.layers=2 data.tokens_per_device=${CAD_TOKENS:-65536} \
           data.length_scale=1 ${CAD_EXTRA:-} 2>&1 | grep -v -i warn | tee "$OUT/cad.log"
         if [ -n "$CAD_TRACE" ]; then
           find "$CAD_TRACE"/*-distca -name 'perfetto_trace.json.gz' -exec cp {} "$OUT/cad_trace.json.gz" \;
           python3 -P launch/tools/overlap_report.py "$OUT/cad_trace.json.gz" 2>&1 | tee "$OUT/overlap.log"
         fi ;;
    hf) JAX_PLATFORMS=cpu timeout -k 10 ${HF_TIMEOUT:-150} python3 -P launch/tools/hf_reference_check.py 2>&1 \
           | grep -v -i warn | tee -a "$OUT/hf.log" ;;
    overhead) CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${O_TIMEOUT:-560} python3 -P launch/bench_train.py --suite overhead \
           --tokens ${O_TOKENS:-65536} --batches ${O_BATCHES:-pretrain prolong uniform} --warmup 1 --steps 3 \
           --json "$OUT/overhead.json" model.preset=llama3_8b model.layers=${O_LAYERS:-2} data.length_scale=1 \
           ${O_EXTRA:-} 2>&1 | grep -v -i warn | tee -a "$OUT/overhead.log" ;;
    ppmem) CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${M_TIMEOUT:-400} python3 -P launch/bench_train.py --suite pp \
           --compile-only --gpu-mock ${M_STAGES:-2} --batches ${M_BATCHES:-pretrain} \
           --microbatches ${M_MICROBATCHES:-4} model.preset=llama3_8b model.layers=${M_LAYERS:-4} \
           data.tokens_per_device=${M_TOKENS:-65536} data.length_scale=1 model.remat=full 2>&1 \
           | grep -v -i warn | tee -a "$OUT/ppmem.log" ;;
    pp) timeout -k 10 ${PP_TIMEOUT:-420} python3 -P launch/bench_train.py --suite pp --batches ${PP_BATCHES:-skewed pretrain} \
           --microbatches ${PP_MICROBATCHES:-4} --warmup 1 --steps 2 --json "$OUT/pp.json" \
           ${PP_TRACE:+--trace-dir $PP_TRACE} model.preset=llama3_8b \
           model.layers=${PP_LAYERS:-4} data.tokens_per_device=${PP_TOKENS:-65536} data.length_scale=1 2>&1 \
           | grep -v -i warn | tee -a "$OUT/pp.log" ;;
    ragged) # The ragged exchange against tiled, once per XLA ragged-all-to-all implementation,
           # each in its own process so a hang or crash costs only its own R_TIMEOUT (SIGKILL 10 s
           # later: a hung NCCL process that ignores SIGTERM would hold the GPUs for the next
           # command). The device kernel (one launch, no host wait, NVLink and network peers)
           # is a no-op without symmetric buffers, so it takes both flags.
           python3 -c "import importlib.metadata as m; print('NCCL', [d.version for d in m.distributions() if d.metadata['Name'].startswith('nvidia-nccl')])" | tee -a "$OUT/ragged.log"
           for impl in ${R_IMPLS:-nccl oneshot device}; do
             case $impl in
               nccl) flags="" ;;
               oneshot) flags="--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true" ;;
               device) flags="--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true --xla_gpu_experimental_enable_nccl_symmetric_buffers=true" ;;
               *) echo "R_IMPLS: unknown $impl"; continue ;;
             esac
             mkdir -p "$OUT/ragged_$impl"
             XLA_FLAGS="${XLA_FLAGS:-} $flags" timeout -k 10 ${R_TIMEOUT:-240} python3 -P launch/bench_train.py --suite cad \
               --warmup 1 --steps 3 --json "$OUT/ragged_$impl/cad.json" --batches ${R_BATCH:-prolong} \
               --pingpong-ablation "" --wlb-cp "" --ragged-ablation ${R_BATCH:-prolong} model.preset=llama3_8b model.layers=2 \
               data.tokens_per_device=${R_TOKENS:-65536} data.length_scale=1 2>&1 | grep -v -i warn \
               | sed "s/^/[$impl] /" | tee -a "$OUT/ragged.log"
           done ;;
    exchange) CUDA_VISIBLE_DEVICES=0 python3 -P launch/bench_exchange.py --gpu-mock --compile ${X_DEVICES:-8 16 32 64} \
           --batches ${X_BATCHES:-1} --tokens ${X_TOKENS:-65536} --timeout ${X_TIMEOUT:-240} \
           --step-layers ${X_STEP_LAYERS:-2} 2>&1 \
           | grep -v -i warn | tee -a "$OUT/exchange.log" ;;
    kernels) export CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda
           [ "${K_TESTS:-}" = none ] || timeout -k 10 ${K_TEST_TIMEOUT:-240} python3 -P -m pytest -q -rf --tb=line --disable-warnings -p no:cacheprovider \
             tests/test_kernels.py -k "${K_TESTS:-bfloat16}" 2>&1 | grep -v Warning | tail -25 | tee -a "$OUT/kernel_tests.log"
           [ "${K_ARGS:-}" = none ] || timeout -k 10 ${K_TIMEOUT:-330} python3 -P launch/bench_kernels.py --out "$OUT" ${K_ARGS:-} 2>&1 | grep -v -i warn \
             | tee -a "$OUT/kernels.log"
           unset CUDA_VISIBLE_DEVICES JAX_PLATFORMS ;;
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
    ktrace) for ctx in ${T_CONTEXTS:-65536 131072}; do
             CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda timeout -k 10 ${T_TIMEOUT:-200} python3 -P launch/tools/ab_mosaic.py \
               ${T_VERSIONS:-now=} --rounds ${T_ROUNDS:-3} --datasets ${T_DATASETS:-prolong} --context $ctx --trace 2>&1 \
               | grep -v -i warn | tee -a "$OUT/ktrace.log"
           done ;;
    tests) JAX_PLATFORMS=cuda timeout -k 10 ${T_TIMEOUT:-240} python3 -P -m pytest -q -p no:cacheprovider ${T_FILES:-tests/test_dispatch.py} \
           -k "${T_K:-ragged}" 2>&1 | grep -v -i warn | tail -15 | tee -a "$OUT/tests.log" ;;
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
    profile) rm -rf /tmp/profile
           timeout -k 10 ${P_TIMEOUT:-300} python3 -P launch/profile_steps.py model.preset=llama3_8b model.layers=2 \
             data.tokens_per_device=${P_TOKENS:-65536} data.length_scale=1 attention.impl=${P_IMPL:-distca} \
             train.out_dir=/tmp/profile ${P_EXTRA:-} 2>&1 | grep -v -i warn | tee -a "$OUT/profile.log"
           cp /tmp/profile/profile.json /tmp/profile/attention_load.png "$OUT/" 2>/dev/null ;;
    gaterun) n=$(nvidia-smi -L | wc -l)
           for impl in colocated distca; do  # the same sampled batches, one run per attention
             timeout -k 10 ${G_TIMEOUT:-280} python3 -P launch/train.py model.preset=llama3_8b model.layers=2 \
               data.tokens_per_device=${G_TOKENS:-65536} data.length_scale=1 data.distribution=${G_DIST:-pretrain} \
               mesh.data=$n attention.impl=$impl train.steps=${G_STEPS:-24} train.progress=false optim.lr=3e-4 \
               train.tensorboard=false checkpoint.every=0 train.out_dir="/tmp/gaterun_$impl" ${G_EXTRA:-} 2>&1 \
               | grep -v -i warn > "$OUT/gaterun_$impl.log"; tail -6 "$OUT/gaterun_$impl.log"
           done
           python3 -P launch/tools/gate_report.py "$OUT/gaterun_colocated.log" "$OUT/gaterun_distca.log" \
             | tee "$OUT/gaterun.md" ;;
    *) echo "unknown suite $suite (bash launch/gpu_session.sh --help lists them)" ;;
  esac
done
