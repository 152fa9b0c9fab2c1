#!/usr/bin/env bash
# The GPU figures quoted in the issues' closing notes, one part per device call:
#   bash bench/h200.sh checks|fitted|fittedvs|attention|decode64|decode256|linear|report|decodevs|logprobs|train|trainstep|trainmem|trainvs|tis|long|ddp|ddp2|sizes|engmem|trl|mb|offload|compile100|speed|speedbig|templates
# (and `revs`, run here before a device call, not there)
# Needs the data folder (config.json, tokenizer, GSM8K jsonl) at $MINIGRPO_DATA (default ../shared/data).
# Results land in $OUT (default ./out).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; export OUT; mkdir -p "$OUT"
DATA=${MINIGRPO_DATA:-../shared/data}
LEAN="--weights bf16 --activation-checkpointing --logprob-chunk-size 256"  # TRL's memory setting (README)
rand() {  # random weights at a published Qwen2.5 shape (0.5b, 1.5b, 3b, 7b) in /tmp/rand05b, rand15b, rand3b,
          # rand7b, written once per machine, with the 0.5B's tokenizer (the family shares it)
  local cfg=$DATA/configs/qwen2.5-$1-instruct/config.json
  [ "$1" = 0.5b ] && cfg=$DATA/qwen2.5-0.5b-instruct/config.json
  [ -d "/tmp/rand${1/./}" ] || python3 weights/download.py --random-init --config "$cfg" --device cuda \
    --tokenizer-dir "$DATA/qwen2.5-0.5b-instruct" --out "/tmp/rand${1/./}"  # drawn on the GPU: seconds, not minutes
}
case "${1:-}" in
  checks)      # correctness on the GPU: kernels in bf16, logits / greedy vs transformers, engine modes (~10 min:
               # more than one call's limit; split it with pytest flags, e.g. `checks -k "not bf16"`, then
               # `checks -k bf16`)
    python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 150 tests/test_kernels.py tests/test_gpu.py tests/test_memory.py \
      "${@:2}" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^\[|passed|failed|FAILED|Error" ;;
  fitted)      # the same checks on confident weights: the random 0.5B fitted to GSM8K solutions, those of
               # the checked prompts learnt by heart (~3 min; bench/fit_gsm8k.py says why), where bf16
               # greedy parity is a meaningful test
    [ -d /tmp/fit05b ] || python3 bench/fit_gsm8k.py --data "$DATA" --out /tmp/fit05b 2>&1 | tee "$OUT/fit.log" | tail -6
    SEL=("${@:2}"); [ ${#SEL[@]} -gt 0 ] || SEL=(tests/test_gpu.py)  # pytest node ids / flags, in order
    MINIGRPO_GPU_WEIGHTS=/tmp/fit05b python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 150 "${SEL[@]}" \
      2>&1 | tee "$OUT/gpu_fitted.log" | grep -E "^\[|passed|failed|FAILED|Error" ;;
  fittedvs)    # issue 20's step on a fitted 0.5B, this tree against .rev/pre (carry .rev; `revs pre=1ffcef6^` here
               # first), 32-row micro-batches, STEPS per variant (default 10; ~5 min). A shorter fit than `fitted`'s,
               # so that both parts fit one call, in a folder of its own (`fitted` checks the longer one)
    [ -d /tmp/fit05b300 ] || python3 bench/fit_gsm8k.py --data "$DATA" --out /tmp/fit05b300 --steps 300 --seconds 140 \
      2>&1 | tee "$OUT/fit.log" | tail -1
    OUT=$OUT/fittedvs python3 bench/speed.py --model-dir /tmp/fit05b300 --data "$DATA" --steps ${STEPS:-10} \
      --variant pre=.rev/pre:--micro-batch-size=32 --variant now=.:--micro-batch-size=32 | sed -n '/^summary/,$p' ;;
  attention)   # decode-attention microbenchmark (Triton vs gather+SDPA vs dense SDPA); issue 20's long contexts:
               # `attention --points 64x8192,256x4096,256x2048`
    python3 bench/attention.py --no-eager --out "$OUT/bench_attention.json" "${@:2}" ;;
  decode64)    # engine vs HF generate, 8 GSM8K prompts x 8 samples x 256 tokens; every backend x mode by default
               # (over 9 min: more than one call). Issue 20's row and its peer: `decode64 --attn triton --modes
               # step+graphs --sampler triton --peers static`
    python3 bench/decode.py --workloads 8x8 "${@:2}" ;;
  decode256)   # 32 prompts x 8 samples x 256 tokens
    python3 bench/decode.py --workloads 32x8 "${@:2}" ;;
  linear)      # the decode matmuls alone: cuBLAS vs a skinny split-K Triton kernel, per shape and as a chain
               # (`linear --sweep`, ~5 min; NOTES session 15); `linear --rows 64 --pdl`: chains with
               # programmatic dependent launch and an L2 weight prefetch (~1 min; NOTES session 17)
    python3 bench/linear.py "${@:2}" ;;
  report)      # graphs, graph breaks and kernel launches per decode step, per backend
    python3 bench/decode.py --report "${@:2}" ;;
  decodevs)    # the 64-sequence decode step (Triton, compiled, CUDA graphs) of this tree, of each code version named
               # (trees in .rev/, see revs; carry .rev) and of this tree with Inductor's programmatic dependent
               # launch (TORCHINDUCTOR_ENABLE_PDL=1), one process each, in one call (~80 s each):
               # `decodevs merge` after `revs merge=i20merge` here
    ARGS=(--workloads 8x8 --attn triton --modes step+graphs --sampler triton --peers none)
    O=$(realpath "$OUT")
    for t in . "${@:2}"; do
      d=.; [ "$t" = . ] || d=.rev/$t
      echo "== ${t/#./main}"; (cd "$d" && PYTHONPATH=$PWD python3 bench/decode.py "${ARGS[@]}" --out "$O/decode_${t/#./main}") \
        | grep -E "^triton|floors"
    done
    echo "== main, TORCHINDUCTOR_ENABLE_PDL=1"
    TORCHINDUCTOR_ENABLE_PDL=1 python3 bench/decode.py "${ARGS[@]}" --out "$O/decode_pdl" | grep -E "^triton|floors" ;;
  logprobs)    # memory of chunked vs full-logit log-probs
    python3 bench/logprobs_memory.py ;;
  train)       # one full Dr. GRPO step per backend on a random-initialised Qwen2.5-0.5B
    rand 0.5b
    for attn in triton sdpa; do
      python3 train.py --model-dir /tmp/rand05b --train-data "$DATA/gsm8k/train.jsonl" \
        --device cuda --attn "$attn" -B 8 -G 8 --max-new-tokens 256 -K 2 --beta 0.04 --steps 2 --eval-every 0 \
        --save-every 0 --sample-every 0 --out "$OUT/train_$attn" "${@:2}" 2>&1 | tail -4
    done ;;
  trainstep)   # every phase timed (stand-in reward, see bench/train_step.py), plus a full-logits update run;
               # sdpa without compile saves its ~70 s step compile (only the phases after the rollout differ)
    rand 0.5b
    python3 bench/train_step.py --model-dir /tmp/rand05b --data "$DATA" --attn triton,sdpa:none --steps 3 \
      --full-logits "${@:2}" ;;
  trainmem)    # update-phase memory with activation checkpointing: chunked vs full logits (no step compile)
    rand 0.5b
    python3 bench/train_step.py --model-dir /tmp/rand05b --data "$DATA" --attn triton:none --full-logits \
      -- --activation-checkpointing "${@:2}" ;;
  trainvs)     # issue 5's acceptance set in one call (~9 min): the default (fp32 master weights, compiled
               # policy), the memory-lean setting, its full-logits baseline, the lean setting with 32-row
               # micro-batches (fewer launches, more memory), then TRL (needs .peers/, see trl)
    rand 0.5b
    T="python3 bench/train_step.py --model-dir /tmp/rand05b --data $DATA"
    OUT=$OUT/default $T --attn triton --steps 5 2>&1 | grep -E "^triton|Error"
    OUT=$OUT/lean $T --attn triton --steps 6 -- $LEAN 2>&1 | grep -E "^triton|Error"
    OUT=$OUT/lean_full $T --attn "" --full-logits --steps 2 -- $LEAN 2>&1 | grep -E "^triton|Error"
    OUT=$OUT/lean_mb32 $T --attn triton --steps 6 -- $LEAN --micro-batch-size 32 2>&1 | grep -E "^triton|Error"
    bash bench/h200.sh trl ;;
  tis)         # the rollout/trainer mismatch and its TIS weights at the 0.5B and 1.5B shapes, LEAN, 8x8x256
    rand 0.5b; rand 1.5b
    for m in 05b 15b; do
      OUT=$OUT/tis_$m python3 bench/train_step.py --model-dir /tmp/rand$m --data "$DATA" --attn triton --steps 3 \
        -- $LEAN "${@:2}" 2>&1 | grep -E "^triton|Error"
    done ;;
  long)        # long generation budgets at 0.5B, 8 x 8 x L: LEAN at L = 1024 and 2048, the default flags at 1024
    rand 0.5b
    T="python3 bench/train_step.py --model-dir /tmp/rand05b --data $DATA --attn triton --steps 5"
    OUT=$OUT/long1024 $T -- $LEAN --max-new-tokens 1024 2>&1 | grep -E "^triton|Error"
    OUT=$OUT/long2048 $T -- $LEAN --max-new-tokens 2048 2>&1 | grep -E "^triton|Error"
    OUT=$OUT/long1024_default $T -- --max-new-tokens 1024 2>&1 | grep -E "^triton|Error" ;;
  ddp)         # issue 6's scaling table: torchrun on 1, 2, 4, 8 GPUs (as many as there are) at a fixed
               # 8 prompts x 8 samples per GPU, the LEAN trainer flags; step time and tokens/s from rank 0
    rand 0.5b
    NG=$(python3 -c "import torch; print(torch.cuda.device_count())")
    for n in 1 2 4 8; do
      [ "$n" -le "$NG" ] || break
      OUT=$OUT/ddp$n torchrun --standalone --nproc-per-node "$n" bench/train_step.py --model-dir /tmp/rand05b \
        --data "$DATA" --attn triton --steps 5 -- $LEAN "${@:2}" 2>&1 | grep -E "^triton|Error"
    done ;;
  ddp2)        # issue 17: why 2 GPUs gave 61% of linear samples/s (NOTES, issue 6), on nvidia-h200-x2; one
               # sub-part per device call, each under 10 minutes:
               #   net: how the GPUs are linked; all-reduce GB/s at the gradient's size under NCCL's default and
               #        forced transports; the transport NCCL picks in a 2-GPU training step (NCCL_DEBUG=INFO)
               #   profile [N...]: one profiled step on N = 1 and 2 GPUs: NCCL kernel time, time without a compute
               #        kernel, per rank (Chrome traces in $OUT/profileN)
               #   scale [05b|7b] [RUN...]: samples/s, step time, peak memory per rank, RUN = ddp1 (one GPU: nothing
               #        is wrapped), ddp2, fsdp2 (default all three; at 7b one RUN per call), LEAN, 8x8x256 per GPU
               # NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set on these machines: KINDS.md).
    T="bench/train_step.py --data $DATA --attn triton"
    case "${2:-}" in
      net)
        rand 0.5b
        { nvidia-smi topo -m; nvidia-smi nvlink -s; python3 -c "import torch; print('peer access 0->1, 1->0:', \
          torch.cuda.can_device_access_peer(0, 1), torch.cuda.can_device_access_peer(1, 0))"; } 2>&1 | tee "$OUT/topo.txt"
        for env in "" NCCL_P2P_DISABLE=1 "NCCL_P2P_DISABLE=1 NCCL_SHM_USE_CUDA_MEMCPY=1" NCCL_P2P_LEVEL=SYS NCCL_CUMEM_ENABLE=0; do
          echo "== ${env:-default}"
          env $env torchrun --standalone --nproc-per-node 2 bench/allreduce.py 2>&1 | grep -E "^\{|Error"
        done | tee "$OUT/allreduce.txt"
        NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET,GRAPH OUT=$OUT/nccl torchrun --standalone --nproc-per-node 2 \
          ${T/--attn triton/--attn triton:none} --model-dir /tmp/rand05b --steps 1 -- $LEAN --no-compile-policy > "$OUT/nccl.log" 2>&1
        grep -E "via (P2P|SHM|NET|CollNet)|P2P/|SHM/|NET/|CUMEM|P2P is disabled|P2P level|NVLS|Connected all|comm 0x.*nRanks" \
          "$OUT/nccl.log" | sed -E 's/^[^ ]+ //; s/[0-9]+:[0-9]+ \[[0-9]\]//' | sort | uniq -c | sort -rn | head -30 ;;
      profile)
        rand 0.5b
        NS=("${@:3}"); [ ${#NS[@]} -gt 0 ] || NS=(1 2)
        for n in "${NS[@]}"; do
          OUT=$OUT/profile$n torchrun --standalone --nproc-per-node "$n" $T --model-dir /tmp/rand05b --steps 4 --profile \
            -- $LEAN 2>&1 | grep -E "^triton|profiled|Error"
        done ;;
      scale)
        M=${3:-05b}; if [ "$M" = 7b ]; then rand 7b; else rand 0.5b; fi
        RUNS=("${@:4}"); [ ${#RUNS[@]} -gt 0 ] || RUNS=(ddp1 ddp2 fsdp2)
        for r in "${RUNS[@]}"; do  # ddp2 -> --parallel ddp on 2 GPUs
          OUT=$OUT/${M}_$r torchrun --standalone --nproc-per-node "${r: -1}" $T --model-dir "/tmp/rand$M" \
            --steps "${STEPS:-8}" -- $LEAN --parallel "${r%?}" 2>&1 | grep -E "^triton|Error"
        done ;;
      *) echo "usage: bash bench/h200.sh ddp2 net | profile [N...] | scale [05b|7b] [ddp1|ddp2|fsdp2 ...]"; exit 2 ;;
    esac ;;
  sizes)       # issue 17's sizes table: random weights at the published shapes given (default: 0.5b 1.5b 3b 7b),
               # 8 x 8 x 256, K = 2, beta 0.04, 3 steps, with the default flags and the LEAN ones. Each run prints
               # warm_step_s, peak_gib and the memory estimate (estimate_drawn_gib: for the prompts the steps drew,
               # estimate_error against peak_gib), or `refused` with the one line the memory check stopped it with.
               # About 3 min per size up to 3B, 6-7 min for 7b (its 15 GB random model is written first): one
               # device call for `sizes 0.5b 1.5b`, one for `sizes 3b`, one for `sizes 7b`
    SIZES=("${@:2}"); [ ${#SIZES[@]} -gt 0 ] || SIZES=(0.5b 1.5b 3b 7b)
    for m in "${SIZES[@]}"; do
      rand "$m"
      T="python3 bench/train_step.py --model-dir /tmp/rand${m/./} --data $DATA --attn triton --steps 3"
      OUT=$OUT/sizes_${m}_default $T 2>&1 | grep -E "^triton|Error" | sed "s/^triton/$m default/"
      OUT=$OUT/sizes_${m}_lean $T -- $LEAN 2>&1 | grep -E "^triton|Error" | sed "s/^triton/$m lean/"
    done ;;
  engmem)      # issue 17.2: the engine on the bf16 policy's own memory against its private copy (--engine-copy,
               # the behaviour before), LEAN, 8 x 8 x 256, K = 2, beta 0.04, 3 steps, at 0.5B and 7B; per run
               # the per-step peak GB and seconds (step 1 compiles), the KV pool's GB and the sync's seconds
               # (~6 min: 7B weights ~0.5, 0.5B runs ~1 each, 7B runs ~1.5 each)
    rand 0.5b; rand 7b
    for m in 05b 7b; do
      for mode in copy share; do
        OUT=$OUT/engmem_${m}_$mode python3 bench/train_step.py --model-dir /tmp/rand$m --data "$DATA" --attn triton \
          --steps 3 $([ $mode = copy ] && echo --engine-copy) -- $LEAN "${@:2}" 2>&1 | grep -E "^triton|Error" \
          | sed "s/^triton/$m $mode/"
      done
    done ;;
  trl)         # the peer: TRL GRPOTrainer on the same workload (../shared/peers/trl_baseline.py). Its wheels and
               # script must travel in .peers/ (git-ignored; carry it): cp ../shared/peers/{wheels/*.whl,*.py} .peers/
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl
    mkdir -p /tmp/peers && cp .peers/trl_baseline.py /tmp/peers/ && ln -sfn "$(realpath "$DATA")" /tmp/data
    PYTHONPATH=/tmp/site CACHE=${CACHE:-static} STEPS=${STEPS:-6} python3 /tmp/peers/trl_baseline.py 2>&1 | tail -3 ;;
  revs)        # HERE, before the device call: code versions for speed / speedbig as plain trees in .rev/NAME
               # (git-ignored; carry .rev): bash bench/h200.sh revs before=d4a5416 static=55e39d6 (main just
               # before issue 20's levers; levers 1-4 with static shapes)
    for spec in "${@:2}"; do
      rm -rf ".rev/${spec%%=*}" && mkdir -p ".rev/${spec%%=*}" && git archive "${spec#*=}" | tar -x -C ".rev/${spec%%=*}"
    done ;;
  speed)       # issue 20 (~6 min): 0.5B, 8 x 8 x 256, K = 2, beta 0.04, LEAN; one process and one cold compile cache
               # per variant: levers 1-4 on static shapes (.rev/static) and all levers (dynamic shapes), 32-row
               # micro-batches, and all levers with 1024-token LM-head chunks; profiled updates of the static
               # and dynamic ones (bench/speed.py says what each column is). before (.rev/before) and 16 rows
               # ran in calls 3-4 of session 9: add `--variant before=.rev/before --variant after16=.` for
               # them. Carry .rev and .devdata.
    rand 0.5b
    python3 bench/speed.py --model-dir /tmp/rand05b --data "$DATA" --steps ${STEPS:-8} --profile after32 \
      --profile static32 --variant static32=.rev/static:--micro-batch-size=32 \
      --variant after32=.:--micro-batch-size=32 \
      --variant after32c1024=.:--micro-batch-size=32,--logprob-chunk-size=1024 "${@:2}" ;;
  mb)          # issue 20's micro-batch shapes, LEAN, and TRL on the same workload in the same call. `mb 05b` (~8 min):
               # 16, 32 and 64 rows per micro-batch, the 64 one profiled. `mb 15b` (~4 min), `STEPS=5 mb 7b` (~6 min,
               # TRL's random 7B is drawn on the CPU): 32 rows, the README's LEAN recipe, plus FLAGS (comma-separated,
               # e.g. FLAGS=--offload-reference,--recompute-layers=23); TRL=0 leaves TRL out (ours only, ~2 min);
               # PROFILE=1 profiles one more mb32 step (the update's GPU-busy share and top kernels)
    M=${2:-05b}; V=(--variant "mb32=.:--micro-batch-size=32${FLAGS:+,$FLAGS}")
    [ "${PROFILE:-0}" = 1 ] && V+=(--profile mb32)
    [ "$M" = 05b ] && V=(--variant mb16=. "${V[@]}" --variant mb64=.:--micro-batch-size=64 --profile mb64)
    rand ${M/5b/.5b}
    OUT=$OUT/mb$M python3 bench/speed.py --model-dir /tmp/rand$M --data "$DATA" --steps ${STEPS:-6} "${V[@]}" \
      | sed -n '/^summary/,$p'
    # TRL's steps alternate rollout + update and update: 8 steps give 3 warm pairs, a median (one pair is no figure:
    # its rollout swings by 50% at 1.5B and 7B)
    C=$DATA/configs/qwen2.5-${M/5b/.5b}-instruct
    [ "$M" = 05b ] && C=$DATA/qwen2.5-0.5b-instruct
    [ "${TRL:-1}" = 0 ] || CONFIG=$(realpath "$C") STEPS=8 bash bench/h200.sh trl ;;
  offload)     # the KL reference offloaded (--offload-reference) against resident, LEAN, 32-row micro-batches, at one
               # size, and with a layer count R given, offloaded with only R layers recomputed: `offload 7b 23`
               # (~7 min), `offload 15b` (~3 min): s/step by phase and peak memory
    M=${2:-7b}; rand ${M/5b/.5b}
    V=(--variant mb32=.:--micro-batch-size=32 --variant mb32off=.:--micro-batch-size=32,--offload-reference)
    [ -n "${3:-}" ] && V+=(--variant "mb32off_r$3=.:--micro-batch-size=32,--offload-reference,--recompute-layers=$3")
    OUT=$OUT/offload$M python3 bench/speed.py --model-dir /tmp/rand$M --data "$DATA" --steps ${STEPS:-5} "${V[@]}" \
      | sed -n '/^summary/,$p' ;;
  compile100)  # issue 20's compile bound: a 100-step run at 0.5B (LEAN, 32-row micro-batches; ~3 min): seconds
               # compiling in all, and in which steps. Random weights write all 256 tokens, so the engine's
               # smaller batch buckets, which trained weights reach as sequences stop, are not exercised:
               # `compile100 fit` runs on the weights fitted to GSM8K (bench/fit_gsm8k.py, ~3 min more), whose
               # completions stop at EOS
    M=/tmp/rand05b; rand 0.5b
    if [ "${2:-}" = fit ]; then
      M=/tmp/fit05b; [ -d $M ] || python3 bench/fit_gsm8k.py --data "$DATA" --out $M 2>&1 | tail -2
    fi
    mkdir -p "$OUT/compile100"  # recompiles.log: each recompile's function and failed guard, then its step
    OUT=$OUT/compile100 TORCH_LOGS=recompiles python3 bench/train_step.py --model-dir $M --data "$DATA" --attn triton \
      --steps ${STEPS:-100} -- $LEAN --micro-batch-size 32 > /dev/null 2> "$OUT/compile100/recompiles.log"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['triton']['every_step']; c=[s['compile_s'] for s in r]; \
print('steps', len(c), 'compile_s total', round(sum(c), 1), 'steps compiling', [(i + 1, x) for i, x in enumerate(c) if x > 0.5], \
'median step', sorted(s['time_step'] for s in r)[len(r) // 2])" "$OUT/compile100/train_step.json"
    sort -k2 -gr "$OUT"/compile100/train_*/compile_times.txt | head -12  # "stage  seconds" lines
    echo "recompiles per function (decode_step: the engine; forward: a decoder layer; _chunk_*: log-probs; _adamw_chunk):"
    grep -o "Recompiling function [^ ]*" "$OUT/compile100/recompiles.log" | sort | uniq -c
    echo "each with its failed guards, then the step it fell in:"
    grep -E "Recompiling function|^step [0-9]+ compiled| - [0-9]+/[0-9]+: " "$OUT/compile100/recompiles.log" \
      | sed 's/^.*\[__recompiles\] *//' | cut -c1-180 ;;
  speedbig)    # the same at the 1.5B and 7B shapes (MODELS="15b 7b"; ~4 min each), before and after (32-row
               # micro-batches); TRL: the trl part
    for m in ${MODELS:-15b 7b}; do
      rand ${m/5b/.5b}
      OUT=$OUT/$m python3 bench/speed.py --model-dir /tmp/rand$m --data "$DATA" --steps ${STEPS:-5} \
        --variant before=.rev/before --variant after32=.:--micro-batch-size=32 "${@:2}" | sed -n '/^summary/,$p'
    done ;;
  templates)   # issue 18: each --template through the engine, 3 steps of 8 x 8 x 256 on the random 0.5B: s/step,
               # rollout tok/s, how completions ended; a stop-string probe on the engine's output; a sampled
               # evaluation (r1, 4 samples x 32 test examples). One process, one compile (~3 min in all)
    rand 0.5b
    python3 bench/templates.py --model-dir /tmp/rand05b --data "$DATA" "${@:2}" ;;
  *) echo "usage: bash bench/h200.sh checks|fitted|attention|decode64|decode256|linear|report|decodevs|logprobs|train|trainstep|trainmem|trainvs|tis|long|ddp|ddp2|sizes|engmem|trl|mb|compile100|speed|speedbig|templates|revs [args]"
     exit 2 ;;
esac
