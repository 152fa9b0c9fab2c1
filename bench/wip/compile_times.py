"""Run a bench script and print torch._dynamo's aggregated compile times (per phase) to stderr at exit.

    PYTHONPATH=$PWD python bench/wip/compile_times.py bench/wip/opaque_attention_compile.py --layers 24
"""
import atexit, runpy, sys, torch
def dump():
    from torch._dynamo.utils import compile_times
    print(compile_times(repr="str", aggregate=True), file=sys.stderr)
atexit.register(dump)
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
