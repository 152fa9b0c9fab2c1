# `bench/h200.sh compile100 [fit]` for two code versions, .rev/before and .rev/region (session 34: 71c628a and the
# merged regional decode step, 695e09e), each with a fresh Inductor and Triton cache, so that neither run reuses
# graphs or kernels another run compiled (session 33: main's run after v4b's on one host found the trainer's
# graphs cached). Here first: `bash bench/h200.sh revs before=REV region=REV`; carry .rev and .devdata. Device, ~3 min:
#   STEPS=20 bash bench/wip/compile100-pair.sh        (random weights; add `fit` for the fitted ones, +4 min;
#   TREES="main region" for one run each)
set -u
D=$PWD/.devdata; O=$(realpath "${OUT:-out}"); mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader
i=0
for t in ${TREES:-main region main}; do
  i=$((i + 1)); r=$O/$i-$t; dir=.rev/before; [ $t = region ] && dir=.rev/region
  c=$(mktemp -d); mkdir -p $r
  echo "== $t"
  (cd $dir && TORCHINDUCTOR_CACHE_DIR=$c/inductor TRITON_CACHE_DIR=$c/triton MINIGRPO_DATA=$D OUT=$r \
     bash bench/h200.sh compile100 "$@" > $r/compile100.out 2>&1
   grep -E "^steps|Recompiling function|fitted|GraphLowering.run|aot_collect" $r/compile100.out
   python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['triton']['every_step'][0]; \
print({k: s[k] for k in ('time_rollout', 'time_logprobs', 'time_update', 'compile_s')})" $r/compile100/train_step.json)
done
