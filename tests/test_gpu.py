"""GPU acceptance checks at the exact Qwen2.5-0.5B shape, random weights, bf16 (run on the device machine).

    python -m pytest -q -s -m gpu tests/test_gpu.py

Figures are printed and, when $OUT is set, written to $OUT/gpu_checks.jsonl.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.workload import gsm8k_prompts, qwen_dir, random_qwen  # noqa: E402
from minigrpo.checkpoint import save_model  # noqa: E402
from minigrpo.engine import Engine, EngineConfig  # noqa: E402
from minigrpo.generate import generate  # noqa: E402

pytestmark = pytest.mark.gpu
NEW = 64


def record(name, **figures):
    print(f"\n[{name}] " + json.dumps(figures))
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "gpu_checks.jsonl", "a") as f:
            f.write(json.dumps({"check": name, **figures}) + "\n")


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.fixture(scope="module")
def setup():
    if not qwen_dir().exists():
        pytest.skip(f"no data folder at {qwen_dir()} (set MINIGRPO_DATA)")
    tok, prompts = gsm8k_prompts(8)
    return tok, prompts


@pytest.fixture(scope="module", params=[0.02], ids=["hf_init"])
def models(request, tmp_path_factory):
    """Our bf16 model and transformers' loaded from the checkpoint we save, as a user would load it.

    (Not `hf_model.to(torch.bfloat16)`: that also rounds transformers' fp32 RoPE frequencies to bf16, which
    alone moves its logits about 2% away from an fp32 reference; from_pretrained keeps them fp32.)"""
    transformers = pytest.importorskip("transformers")
    ours = random_qwen(std=request.param)
    path = tmp_path_factory.mktemp("ckpt")
    save_model(ours, path, tokenizer_dir=qwen_dir())
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    return ours, hf


@torch.no_grad()
def test_bf16_logits_match_transformers(setup, models):
    _, prompts = setup
    ours, hf = models
    worst = 0.0
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        a, b = ours(ids).float(), hf(ids).logits.float()
        worst = max(worst, ((a - b).norm() / b.norm()).item())
    record("bf16_logits_vs_transformers", max_rel_err=worst, prompts=len(prompts))
    assert worst <= 1e-2


@torch.no_grad()
def test_greedy_continuations_match_transformers(setup, models):
    tok, prompts = setup
    ours, hf = models
    same, firsts = 0, []
    for p in prompts:
        mine = generate(ours, [p], NEW, stop_ids=tok.stop_ids, pad_id=tok.pad_id).tokens[0]
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id)[0, len(p):].tolist()
        ref = ref[:next((i + 1 for i, t in enumerate(ref) if t in tok.stop_ids), len(ref))]
        same += mine == ref
        firsts.append(first_divergence(mine, ref))
    distinct = len({t for p in prompts for t in generate(ours, [p], 16).tokens[0]})
    record("greedy_vs_transformers", identical=same, of=len(prompts), first_divergence=firsts,
           distinct_tokens_in_16_step_continuations=distinct)
    assert same >= 7


MODES = [(attn, comp, graphs) for attn in ("eager", "sdpa", "triton") for comp in ("none", "step")
         for graphs in (False, True)]


@pytest.mark.parametrize("attn, comp, graphs", MODES, ids=[f"{a}-{c}-{'graphs' if g else 'nographs'}" for a, c, g in MODES])
@torch.no_grad()
def test_engine_greedy_matches_reference(setup, models, attn, comp, graphs):
    tok, prompts = setup
    ours, _ = models
    if not hasattr(test_engine_greedy_matches_reference, "ref"):
        test_engine_greedy_matches_reference.ref = [
            generate(ours, [p], NEW, stop_ids=tok.stop_ids, pad_id=tok.pad_id).tokens[0] for p in prompts]
    ref = test_engine_greedy_matches_reference.ref
    engine = Engine(ours.config, EngineConfig(attn=attn, compile=comp, cuda_graphs=graphs, max_batch=8,
                                              max_seq_len=512, kv_pages=512), device="cuda")
    engine.load_weights(ours)
    from minigrpo.sampling import GREEDY
    out = engine.generate(prompts, 1, NEW, GREEDY, stop_ids=tok.stop_ids).tokens
    same = sum(a == b for a, b in zip(out, ref))
    record("engine_greedy_vs_reference", attn=attn, compile=comp, cuda_graphs=graphs, identical=same,
           of=len(prompts), first_divergence=[first_divergence(a, b) for a, b in zip(out, ref)])
    assert engine.kv.num_free == engine.kv.capacity
    assert same >= 7
