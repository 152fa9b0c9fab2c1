# Why patch v4's decode regions save no compile time on the GPU (bench/NOTES.md, session 32): per-phase compile
# times (bench/wip/compile_times.py) for main, v3, v4 and v4b (layer 0's first half outside the region), the
# output code at 3 layers, and v4b's decode speed.
# Here first: bash bench/h200.sh revs before=HEAD region=HEAD v3=HEAD, patch .rev/region with v4 and .rev/v3
# with `git show e6e0b28:bench/wip/regional-decode.patch`; carry .rev and .devdata. Device: bash bench/wip/region-diag.sh
set -u
export PYTHONUNBUFFERED=1 MINIGRPO_DATA=$PWD/.devdata; O=$(realpath "${OUT:-out}"); mkdir -p "$O"
W=$PWD/bench/wip/compile_times.py
fresh() { local c; c=$(mktemp -d); echo "TORCHINDUCTOR_CACHE_DIR=$c TRITON_CACHE_DIR=$c/triton"; }
for t in v4b region before; do for L in 24 1; do
  [ "$t" = before ] || [ "$t" = region ] && [ "$L" = 1 ] && continue
  echo "$t $L $(cd .rev/$t && env $(fresh) PYTHONPATH=$PWD timeout 150 python3 $W bench/compile_decode.py --layers $L 2>$O/times_${t}_$L.err | tail -1)"
done; done
for t in v4b region; do
  (cd .rev/$t && env $(fresh) TORCH_LOGS=output_code,graph_code PYTHONPATH=$PWD timeout 150 python3 bench/compile_decode.py \
     --layers 3 > $O/code_$t.out 2> $O/code_$t.log)
  echo "$t 3 layers: $(cat $O/code_$t.out | tail -1)"; gzip -f $O/code_$t.log
done
(cd .rev/v4b && PYTHONPATH=$PWD timeout 100 python3 bench/decode.py --workloads 8x8 --attn triton --modes step+graphs \
   --sampler triton --peers none --out $O/decode_v4b > $O/decode_v4b.log 2>&1; grep -o '"kernels_per_step": [0-9]*\|"ms_per_step": [0-9.]*' $O/decode_v4b.log)
