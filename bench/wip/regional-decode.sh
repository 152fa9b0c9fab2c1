# The regional decode compile (merged in 6bd763d, session 33; the patch was bench/wip/regional-decode.patch) against
# the tree before it, on the device (bench/NOTES.md, sessions 28-33). Here first:
#   bash bench/h200.sh revs before=71c628a region=HEAD
#   rm -rf .devdata && cp -r ../shared/data .devdata        # then carry .rev and .devdata
# Device: `bash bench/wip/regional-decode.sh speed` (~9 min), then `bash bench/wip/regional-decode.sh tests`.
set -u
export PYTHONUNBUFFERED=1
D=$PWD/.devdata; O=$(realpath "${OUT:-out}"); export MINIGRPO_DATA=$D; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
case "${1:-}" in
  speed)
    for t in region before; do for L in 24 1; do  # the decode step alone, cold, all layers and one: ~1 min each
      echo "$t $(cd .rev/$t && PYTHONPATH=$PWD timeout 150 python3 bench/compile_decode.py --layers $L 2>$O/compile_${t}_$L.err | tail -1)"
    done; done
    PYTHONPATH=$PWD python3 weights/download.py --random-init --config $D/qwen2.5-0.5b-instruct/config.json --device cuda \
      --tokenizer-dir $D/qwen2.5-0.5b-instruct --out /tmp/rand05b > $O/rand.log 2>&1 || tail -5 $O/rand.log
    F=--micro-batch-size=32,--logprob-chunk-size=1024
    PYTHONPATH=$PWD OUT=$O timeout 300 python3 bench/speed.py --model-dir /tmp/rand05b --data $D --steps 4 \
      --variant region32=.rev/region:$F --variant before32=.rev/before:$F 2>&1 | tail -25
    for t in region before; do
      echo "== decode $t"
      (cd .rev/$t && PYTHONPATH=$PWD timeout 240 python3 bench/decode.py --workloads 8x8,32x8 --attn triton \
         --modes step+graphs --sampler triton --peers none --out $O/decode_$t > $O/decode_$t.log 2>&1
       grep -E "^triton|floors|rror" $O/decode_$t.log | tail -8)
    done ;;
  tests)  # bf16 / fp32 greedy parity of every engine mode, the fused sampler in the compiled graph
    (cd .rev/region && PYTHONPATH=$PWD timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 150 \
       tests/test_gpu.py -k "engine or fused_sampler" 2>&1 | tee $O/gpu_tests.log | tail -8) ;;
  *) echo "usage: bash bench/wip/regional-decode.sh speed|tests" >&2; exit 2 ;;
esac
