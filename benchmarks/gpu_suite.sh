#!/usr/bin/env bash
# Every GPU figure the issues ask for, on a CUDA machine (run from the repository root).
#   benchmarks/gpu_suite.sh                 # `arms`: every arm of issue 15 in one call of at most 600 s
#   SUITE_SECONDS=300 ORDER=hf-first ARMS=lora-plain PROFILE=1 benchmarks/gpu_suite.sh   # one order, a profile
#   benchmarks/gpu_suite.sh versions|smoke|speed|speed-hf-first|profile|profile-compile|qlora|strategies|strategies-full|
#                           generate|compile|compile-lora|compile-full|vs-hf|vs-hf-compile|vs-hf-graphs|graphs-why|graphs|head|profile-eager|
#                           profile-graphs|seeds|lora-tests|arms ...
# Wheels the GPU image lacks travel in .whl/ (trl, liger-kernel, and pydantic/datasets where missing; see
# benchmarks/RESULTS.md); OUT (optional) collects the logs, and RESULTS-append.md: the entries the scripts appended
# to benchmarks/RESULTS.md there, to append here (the device's copy of the tree does not come back).
set -u
OUT=${OUT:-/tmp/phalanx-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PHALANX_CACHE=${PHALANX_CACHE:-/tmp/phalanx-cache}
parts=${*:-arms}
results_before=$(wc -l < benchmarks/RESULTS.md)
deadline=$((SECONDS + ${SUITE_SECONDS:-570}))  # the device's per-call limit is 600 s
step() {  # step NAME SECONDS CMD...: one part, time-boxed (and never past the call's deadline)
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then echo "=== $name skipped: the call's time is spent"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name ($(date +%T), at most ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -E "^\s*$|Warning|warn\(|^W[0-9]{4} " | tail -n 40
  local code=${PIPESTATUS[0]}
  echo "=== $name exit $code"
  return "$code"
}
versions() {  # the machine and the packages every figure depends on
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  python3 - <<'PY'
import importlib, importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("transformers", "peft", "trl", "liger-kernel", "bitsandbytes", "datasets", "pyarrow", "pydantic", "accelerate", "triton", "flash-attn"):
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        version = "missing"
    print(f"  {name} {version}")
for module in ("phalanx.train.run", "trl", "liger_kernel.transformers", "bitsandbytes", "torch.nn.attention.varlen"):
    try:
        importlib.import_module(module)
        print(f"  import {module}: ok")
    except Exception as exc:
        print(f"  import {module}: FAILED {type(exc).__name__}: {exc}")
PY
}
model_folder() {  # the R1-Distill-shaped model the profiles read (the arms' scripts build it themselves)
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from train_vs_hf import build_gpu_shape_folder as b; b('r1-distill-qwen-1.5b', Path('/tmp/phalanx-bench/r1-distill-qwen-1.5b-random'), device='cuda')"
}
for part in $parts; do
  case $part in
    arms)  # issue 15 item 5, most important first, each time-boxed against the call's deadline (SUITE_SECONDS).
           # LoRA default, Trainer+PEFT and TRL (padding-free + Liger) on the same rows in both running orders (ORDER:
           # both, phalanx-first or hf-first); QLoRA, full fine-tuning and the A/B arms of the default (no Liger
           # kernels; compiled layers); generation; a profile with PROFILE=1; Unsloth only where it imports.
      versions
      # Sized from the 2026-11-26 H100 calls: each order of the comparison ~110 s, an eager arm ~20-30 s, pip and
      # imports ~25 s. ORDER=both (default) measures both running orders, as issue 15 asks.
      step lora-trainer-trl 250 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 14 --warmup 4 \
        --orders "${ORDER:-both}" --with-trl --note "gpu_suite arms" \
      || { grep -q "^phalanx failed" "$OUT/lora-trainer-trl.log" \
        && step lora-trainer-trl-noliger 165 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 14 \
          --warmup 4 --orders phalanx-first --with-trl --phalanx-flags "--training.liger_kernels false" \
          --note "gpu_suite arms: phalanx's default failed, rerun without Liger's kernels"; }
      # lora-16k: the default with 16,384-token micro-batches, to see how much of the MFU gap is launches per token.
      step phalanx-arms 140 python3 benchmarks/phalanx_arms.py --gpu-shape r1-distill-qwen-1.5b \
        --arms "${ARMS:-qlora,full,lora-plain,lora-16k}" --steps 10 --warmup 4 --arm-timeout 45 \
        --work_dir /tmp/phalanx-bench --note "gpu_suite arms"
      # Generation at the seeds' shape (25 sequences per question, batch 38), two rounds, both decoding caches: the
      # 2026-11-26 run (growing cache, 16 rows, one round) decoded at ~131 ms per step for a few ms of GPU work by estimate; the fixed
      # cache replays one CUDA graph per step. Each phalanx arm's prefill/decode split says where time goes.
      # The loop's tokens/s does not depend on how many sequences it runs, so it runs 4 (round-robin over prompts).
      step generate 140 python3 benchmarks/generate_vs_loop.py --device cuda --dtype bfloat16 \
        --model_name /tmp/phalanx-bench/r1-distill-qwen-1.5b-random --num_questions 4 --num_sequences_per_question 25 \
        --batch_size 38 --loop_sequences 4 --repeats 2 --skip-k-loop --kv_caches growing,fixed \
        --note "gpu_suite arms: the seeds' generation shape"
      # Compiled layers: its warm-up outlasted a 65 s box on 2026-11-26, so a long box and 40 steps, 20 of them warm-up.
      # TORCH_LOGS=recompiles: the log says whether packed micro-batches of other lengths recompile the layers (they
      # did, one compile per number of rows, until d705ee4: RESULTS 2026-11-27 03:25). `compile` below is this alone.
      step lora-compile 130 env TORCH_LOGS=recompiles python3 benchmarks/phalanx_arms.py --gpu-shape r1-distill-qwen-1.5b --arms lora-compile \
        --steps 40 --warmup 20 --arm-timeout 125 --work_dir /tmp/phalanx-bench --note "gpu_suite arms: compile's A/B"
      # Where a default LoRA step's time goes (kernels, host work, launches): PROFILE=1, or a second call.
      [ -n "${PROFILE:-}" ] && step profile 60 python3 benchmarks/profile_step.py --skip 2 --rows 22 -- \
        --model_name /tmp/phalanx-bench/r1-distill-qwen-1.5b-random --max_steps 5 --batch_size 4 --max_length 2048 \
        --mixed_precision bf16 --test_size 0 --eval_steps 1000000000 --save_steps 1000000000 --logging.progress_bar false \
        --logging.tensorboard false --output_dir /tmp/phalanx-bench/profile-run --overwrite_output_dir true
      if python3 -c "import unsloth" 2>/dev/null; then
        echo "=== unsloth imports, but benchmarks/ has no Unsloth arm yet: not measured"
      else
        echo "=== unsloth: not importable here (its wheels pin torch/transformers; not carried): not measured"
      fi
      # What each run said about its kernels (compile, Liger, varlen attention, fused cross-entropy), and every error.
      find /tmp/phalanx-bench -maxdepth 2 -name "*.log" -print0 | xargs -0 -r grep -H -E "🧩|🧮|Error|error:|Traceback|packing|padded|Recompiling" \
        | grep -v -E "^[^:]*:W[0-9]{4} " | cut -c1-300 | head -n 30
      find /tmp/phalanx-bench -maxdepth 2 -name "*.log" -print0 | tar czf "$OUT/worker-logs.tar.gz" --null -T - 2>/dev/null ;;
    versions) versions ;;
    vs-hf)  # the LoRA default against Trainer+PEFT and TRL (padding-free + Liger, no checkpointing), ORDER's orders
      step vs-hf 250 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 14 --warmup 4 \
        --orders "${ORDER:-both}" --with-trl --note "gpu_suite vs-hf" ;;
    vs-hf-compile)  # issue 15's 2.0x figure as a long run gets it: compiled layers (what training.compile auto picks
           # for a LoRA run of >= 400 micro-batches) against Trainer+PEFT, both orders, 24 steps, 12 of warm-up (about
           # 220 s on an H200, 2026-11-28: 2.86x in each order)
      step vs-hf-compile 300 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 24 --warmup 12 \
        --orders "${ORDER:-both}" --phalanx-flags "--training.compile true" \
        --note "gpu_suite vs-hf-compile: compiled layers, the long-run default" ;;
    head)  # compiled layers with Liger's fused linear cross-entropy (the default where liger-kernel is installed) against
           # phalanx's chunked head (training.liger_kernels false), which takes no host sync: 40 steps, 20 of warm-up
      step phalanx-arms-head 400 env TORCH_LOGS=recompiles,graph_breaks python3 benchmarks/phalanx_arms.py \
        --gpu-shape r1-distill-qwen-1.5b --arms "${ARMS:-lora-compile,lora-compile-chunked-head}" --steps 40 \
        --warmup 20 --arm-timeout 190 --work_dir /tmp/phalanx-bench --note "gpu_suite head: Liger's head or the chunked one" ;;
    graphs-why)  # why inductor would not graph a whole layer (2026-11-28: "cpu ops", a 2-element tensor): with graph
           # partitioning off, cudagraph trees skip a graph that holds a CPU node and log the node's name and the
           # stack trace of its first use (torch/_inductor/cudagraph_utils.py); 8 steps are enough to compile it.
      step graphs-why 150 env TORCHINDUCTOR_GRAPH_PARTITION=0 TORCH_LOGS=cudagraphs python3 benchmarks/phalanx_arms.py \
        --gpu-shape r1-distill-qwen-1.5b --arms lora-graphs --steps 8 --warmup 4 --arm-timeout 140 \
        --work_dir /tmp/phalanx-why --note "gpu_suite graphs-why: graph partitioning off, to name the CPU node"
      find /tmp/phalanx-why -maxdepth 2 -name "*.log" -print0 | xargs -0 -r grep -h -A 14 -E "skipping cudagraphs|cpu device" \
        | cut -c1-240 | head -n 60
      find /tmp/phalanx-why -maxdepth 2 -name "*.log" -exec cp {} "$OUT/" \; ;;  # the whole account comes back
    graphs)  # training.cuda_graphs, which ran slower than compiled layers without graphs on an H200 (2026-11-28: 9,966
           # against ~25,000 tokens/s, 112 s to the first step). Inductor split each layer's forward at a 2-element
           # CPU tensor copied to the GPU (perhaps the seed and offset of the LoRA dropout drawn inside the layer: not
           # checked), so graphs and compiled layers with lora_dropout 0 (no random draw in the graph), then 0.05, the
           # graphed arm in a 200 s box (its first step took 112 s), then what the runs said about their graphs.
      step phalanx-arms-graphs-p0 330 env TORCH_LOGS=recompiles,graph_breaks python3 benchmarks/phalanx_arms.py \
        --gpu-shape r1-distill-qwen-1.5b --arms "${ARMS:-lora-graphs,lora-compile}" --lora_dropout 0 --steps 40 \
        --warmup 20 --arm-timeout 200 --work_dir /tmp/phalanx-bench --note "gpu_suite graphs: lora_dropout 0"
      step phalanx-arms-graphs 220 env TORCH_LOGS=recompiles,graph_breaks python3 benchmarks/phalanx_arms.py \
        --gpu-shape r1-distill-qwen-1.5b --arms lora-graphs --steps 40 --warmup 20 --arm-timeout 200 \
        --work_dir /tmp/phalanx-bench --note "gpu_suite graphs: lora_dropout 0.05"
      find /tmp/phalanx-bench -maxdepth 2 -name "*.log" -print0 | xargs -0 -r grep -H -E "📐|⚠️|cudagraph|CUDAGraph|Error|Traceback" \
        | cut -c1-300 | head -n 40 ;;
    vs-hf-graphs)  # phalanx with CUDA graphs over compiled layers (training.cuda_graphs, not the default) against
           # Trainer+PEFT, both orders: 30 steps, 15 of warm-up (compiling and capturing the first shapes)
      step vs-hf-graphs 420 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 30 --warmup 15 \
        --orders "${ORDER:-both}" --phalanx-flags "--training.cuda_graphs true" \
        --note "gpu_suite vs-hf-graphs: phalanx with --training.cuda_graphs true" ;;
    compile|compile-lora|compile-full)  # compiled layers against the eager default at 40 steps, 20 of warm-up (CUDA
           # graphs capture each new micro-batch shape at its first use): LoRA (compile-lora: CUDA graphs, then the C++
           # kernel launcher, then compiled and eager), full fine-tuning (compile-full) or both (compile). Warm-up is
           # minutes: a call of its own.
      arms=${ARMS:-}
      [ -z "$arms" ] && case $part in
        compile-lora) arms=lora-graphs,lora-compile-cpp,lora-compile,lora ;;
        compile-full) arms=full-compile,full ;;
        *) arms=lora-compile,lora,full-compile,full ;;
      esac
      step "phalanx-arms-$part" 560 env TORCH_LOGS=recompiles,graph_breaks python3 benchmarks/phalanx_arms.py \
        --gpu-shape r1-distill-qwen-1.5b --arms "$arms" --steps 40 --warmup 20 --arm-timeout 150 \
        --work_dir /tmp/phalanx-bench --note "gpu_suite $part: compiled layers against eager" ;;
    seeds)  # the seeds' own setting (seed 002: batch 1, 8 micro-batches per step): phalanx's merged passes (default,
           # and 16,384-token passes) against one pass per micro-batch; then against Trainer+PEFT and TRL, both orders.
           # About 90 s + 2 x 140 s (2026-11-27: the second order did not fit a 465 s call after other parts): a call
           # of its own, or ORDER=phalanx-first.
      step seeds-arms 150 python3 benchmarks/phalanx_arms.py --gpu-shape r1-distill-qwen-1.5b \
        --arms seeds,seeds-merge-16k,seeds-unmerged --steps 8 --warmup 3 --arm-timeout 60 --work_dir /tmp/phalanx-bench \
        --note "gpu_suite seeds: batch 1 x 8 micro-batches, merged and not"
      step seeds-vs-hf 320 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 6 --warmup 2 \
        --batch_size 1 --grad_accum 8 --orders "${ORDER:-both}" --with-trl --note "gpu_suite seeds: the seeds' batch 1 x 8" ;;
    profile-eager|profile-compile|profile-graphs)  # where a LoRA step's time and host waits go: eager (the default),
           # compiled, or compiled and captured as CUDA graphs
           # (135 syncs and 341 copies per compiled step on 2026-11-27: from where?)
      model_folder
      [ "$part" = profile-eager ] && step profile-eager 100 python3 benchmarks/profile_step.py --skip 4 --rows 22 --waits -- \
        --model_name /tmp/phalanx-bench/r1-distill-qwen-1.5b-random --max_steps 7 --batch_size 4 --max_length 2048 \
        --mixed_precision bf16 --test_size 0 --eval_steps 1000000000 --save_steps 1000000000 --training.compile false \
        --logging.progress_bar false --logging.tensorboard false --output_dir /tmp/phalanx-bench/profile-eager \
        --overwrite_output_dir true
      [ "$part" = profile-compile ] && step profile-compile 120 python3 benchmarks/profile_step.py --skip 4 --rows 22 --waits -- \
        --model_name /tmp/phalanx-bench/r1-distill-qwen-1.5b-random --max_steps 7 --batch_size 4 --max_length 2048 \
        --mixed_precision bf16 --test_size 0 --eval_steps 1000000000 --save_steps 1000000000 --training.compile true \
        --logging.progress_bar false --logging.tensorboard false --output_dir /tmp/phalanx-bench/profile-compile \
        --overwrite_output_dir true
      # CUDA graphs over the compiled layers: 12 steps before the profile, so that most shapes are captured.
      [ "$part" = profile-graphs ] && step profile-graphs 150 python3 benchmarks/profile_step.py --skip 12 --rows 22 --waits -- \
        --model_name /tmp/phalanx-bench/r1-distill-qwen-1.5b-random --max_steps 15 --batch_size 4 --max_length 2048 \
        --mixed_precision bf16 --test_size 0 --eval_steps 1000000000 --save_steps 1000000000 --training.cuda_graphs true \
        --logging.progress_bar false --logging.tensorboard false --output_dir /tmp/phalanx-bench/profile-graphs \
        --overwrite_output_dir true ;;
    generate)  # generation alone, at the seeds' shape, both decoding caches (about 2 minutes with the model build)
      step generate 240 python3 benchmarks/generate_vs_loop.py --device cuda --dtype bfloat16 --gpu-shape r1-distill-qwen-1.5b \
        --num_questions 4 --num_sequences_per_question 25 --batch_size 38 --loop_sequences 4 --repeats 2 --skip-k-loop \
        --kv_caches growing,fixed --note "gpu_suite generate: the seeds' generation shape" ;;
    lora-tests)  # tests/models/test_lora_fused.py on the GPU: CUDA's dropout kernel and generator, its mixed-dtype
      # kernels (a bool mask in addcmul_), kept casts under CUDA autocast; pytest travels in .whl/ where the image lacks it
      step lora-tests 240 env PHALANX_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -m "not distributed" \
        tests/models/test_lora_fused.py ;;
    smoke)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)"
      step env 60 python3 -m phalanx env
      for mp in bf16 fp16; do
        step "train-$mp" 120 python3 -m phalanx train configs/demo.yaml --world_size 1 --max_steps 12 --eval_steps 6 \
          --save_steps 6 --mixed_precision $mp --output_dir /tmp/smoke-$mp --overwrite_output_dir --logging.progress_bar false
      done
      step resume-bf16 120 python3 -m phalanx train configs/demo.yaml --world_size 1 --max_steps 16 --eval_steps 6 \
          --save_steps 6 --mixed_precision bf16 --output_dir /tmp/smoke-bf16 --force --logging.progress_bar false ;;
    speed)
      step train_vs_hf 540 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 30 --no-results --orders phalanx-first --with-unpacked ;;
    speed-hf-first)  # the same comparison in the other order: the first run on a fresh machine pays its warm-up
      step train_vs_hf_hf_first 540 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 30 --no-results --orders hf-first --with-unpacked ;;
    profile)  # cProfile of rank 0 on both sides (timings perturbed); .prof files under $OUT/prof
      step profile 300 python3 benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --steps 15 --no-results --profile "$OUT/prof" ;;
    qlora)  # 4-bit NF4 base vs plain LoRA on the 1.5B shape: peak memory and time (model folder from the speed part)
      for q in true false; do
        step "qlora-$q" 180 python3 -m phalanx train --model_name /tmp/phalanx-bench/r1-distill-qwen-1.5b-random --max_steps 12 \
          --batch_size 4 --max_length 2048 --test_size 0 --eval_steps 100 --save_steps 100 --mixed_precision bf16 \
          --output_dir /tmp/qlora-$q --overwrite_output_dir --logging.progress_bar false --load_in_4bit $q
      done ;;
    strategies)
      step strategies-lora 480 python3 benchmarks/strategies.py --gpu-shape r1-distill-qwen-1.5b --world_size 1 --batch_size 4 \
        --steps 12 --warmup 3 --offload --only ddp "fsdp FULL_SHARD" "ZeRO-2" "ZeRO-3" "fsdp FULL_SHARD + offload" \
        "ZeRO-3 + param/optimizer offload" ;;
    strategies-full)
      step strategies-full 480 python3 benchmarks/strategies.py --gpu-shape r1-distill-qwen-1.5b --world_size 1 --batch_size 4 \
        --steps 8 --warmup 3 --finetune full --gradient_checkpointing --offload --only ddp "fsdp FULL_SHARD" \
        "fsdp FULL_SHARD + offload" "ZeRO-3" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
# Appended: a call may run this script more than once, and $OUT is emptied only between calls.
tail -n +$((results_before + 1)) benchmarks/RESULTS.md >> "$OUT/RESULTS-append.md"
echo "=== $(wc -l < "$OUT/RESULTS-append.md") lines appended to benchmarks/RESULTS.md: $OUT/RESULTS-append.md"
