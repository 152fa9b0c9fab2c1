"""GPU acceptance checks at the exact Qwen2.5-0.5B shape, random weights, bf16 (run on the device machine).

    python -m pytest -q -s -m gpu tests/test_gpu.py
    MINIGRPO_GPU_WEIGHTS=/tmp/fit05b python -m pytest -q -s -m gpu tests/test_gpu.py  # fitted weights

Random weights make bf16 greedy parity a coin toss (near-uniform logits, see bench/fit_gsm8k.py), so
there the bf16 checks only show that every divergence is a near tie. With $MINIGRPO_GPU_WEIGHTS naming a
model directory with confident logits (bench/fit_gsm8k.py writes one) they demand the tokens themselves.

Figures are printed and, when $OUT is set, written to $OUT/gpu_checks.jsonl.
"""

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch.nn.attention import sdpa_kernel

from bench.workload import gsm8k_prompts, qwen_dir, random_qwen
from minigrpo.engine.config import EngineConfig
from minigrpo.engine.engine import Engine
from minigrpo.model.checkpoint import load_model, save_model
from minigrpo.model.generate import Rollout, generate
from minigrpo.model.qwen2 import NOT_CUDNN
from minigrpo.model.sampling import GREEDY

pytestmark = pytest.mark.gpu
NEW = 64
WEIGHTS = os.environ.get("MINIGRPO_GPU_WEIGHTS")  # a model directory to check instead of random weights


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


NEAR_TIE = 0.1  # fp32 logit gap under which a bf16 rounding difference may flip a greedy choice


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Ours and transformers', bf16 and fp32, all with the same random weights (transformers' initialiser).

    transformers' model is loaded from the checkpoint we save, as a user would load it; not converted with
    `hf_model.to(torch.bfloat16)`, which also rounds its fp32 RoPE frequencies to bf16 and alone moves its
    logits about 2% away from an fp32 reference (from_pretrained keeps them fp32)."""
    transformers = pytest.importorskip("transformers")
    ours32 = load_model(WEIGHTS, torch.float32, "cuda").eval() if WEIGHTS else random_qwen(dtype=torch.float32)
    path = tmp_path_factory.mktemp("ckpt")
    save_model(ours32, path, tokenizer_dir=qwen_dir(), dtype=torch.bfloat16)
    hf = {dt: transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=dt).to("cuda").eval()
          for dt in (torch.bfloat16, torch.float32)}
    assert hf[torch.bfloat16].model.rotary_emb.inv_freq.dtype == torch.float32
    ours32 = ours32.to(torch.bfloat16).to(torch.float32)  # the weights the checkpoint holds
    ours16 = copy.deepcopy(ours32).to(torch.bfloat16)
    return {"ours": {torch.bfloat16: ours16, torch.float32: ours32}, "hf": hf}


@torch.no_grad()
def test_bf16_logits_match_transformers(setup, models):
    _, prompts = setup
    ours, hf = models["ours"][torch.bfloat16], models["hf"][torch.bfloat16]
    worst = 0.0
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        with sdpa_kernel(NOT_CUDNN):  # our policy's SDPA backends (qwen2.py): the same kernels on both sides
            a, b = ours(ids).float(), hf(ids).logits.float()
        worst = max(worst, ((a - b).norm() / b.norm()).item())
    record("bf16_logits_vs_transformers", max_rel_err=worst, prompts=len(prompts))
    assert worst <= 1e-2


@sdpa_kernel(NOT_CUDNN)  # the SDPA backends our policy allows (qwen2.py), so both sides run the same kernels
def hf_greedy(hf, prompt, stop_ids, pad_id, cache=True):
    if cache:
        # Plain greedy: the checkpoint's generation_config.json (Qwen's) would add repetition_penalty 1.1.
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW, do_sample=False,
                          repetition_penalty=1.0, top_k=None, top_p=None, temperature=None,
                          eos_token_id=list(stop_ids), pad_token_id=pad_id)[0, len(prompt):].tolist()
    else:  # transformers' own forward, no cache: the same computation our reference generate does
        ids, out = list(prompt), []
        for _ in range(NEW):
            out.append(int(hf(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
            ids.append(out[-1])
            if out[-1] in stop_ids:
                break
    return out[:next((i + 1 for i, t in enumerate(out) if t in stop_ids), len(out))]


@torch.no_grad()
def divergence_gaps(model32, prompts, a_runs, b_runs) -> tuple[list[float], list[float]]:
    """For each pair of continuations that differ: the fp32 logit gap between the two tokens chosen at the
    first divergence, and bf16's spacing at those logits (the resolution of a bf16 LM head's output there).
    A gap far below bf16's rounding error means the flip is numerics, not a bug."""
    gaps, spacings = [], []
    device = next(model32.parameters()).device
    for p, a, b in zip(prompts, a_runs, b_runs):
        i = first_divergence(a, b)
        if i is None or i >= min(len(a), len(b)):
            continue
        logits = model32(torch.tensor([p + a[:i]], device=device))[0, -1].float()
        pair = logits[[a[i], b[i]]]
        gaps.append(round((pair[0] - pair[1]).abs().item(), 4))
        spacings.append(2.0 ** (math.floor(math.log2(pair.abs().max().item())) - 7))  # 8 significant bits
    return gaps, spacings


@torch.no_grad()
def test_greedy_continuations_match_transformers(setup, models):
    """Our reference generate (no cache: a full forward per token) against transformers' forward run the
    same way: identical in fp32 and bf16, since the two models compute bitwise-equal bf16 logits.

    Against transformers' cached `generate`, fp32 is identical too. In bf16 the two sides then run
    different kernels, and random weights give near-uniform logits (std ~0.6 over 151936 tokens) whose top
    two are often closer than bf16 rounding, so they part ways within a few tokens; transformers' own
    cached and uncached greedy do too (recorded). There we check that every divergence is such a near tie."""
    tok, prompts = setup
    stops, pad = tok.stop_ids, tok.pad_id
    figures = {}
    for dt in (torch.float32, torch.bfloat16):
        ours, hf = models["ours"][dt], models["hf"][dt]
        mine = [generate(ours, [p], NEW, stop_ids=stops, pad_id=pad).tokens[0] for p in prompts]
        uncached = [hf_greedy(hf, p, stops, pad, cache=False) for p in prompts]
        cached = [hf_greedy(hf, p, stops, pad) for p in prompts]
        figures[str(dt)] = dict(
            identical_vs_uncached=sum(a == b for a, b in zip(mine, uncached)),
            first_divergence_vs_uncached=[first_divergence(a, b) for a, b in zip(mine, uncached)],
            identical_vs_cached_generate=sum(a == b for a, b in zip(mine, cached)),
            first_divergence_vs_cached_generate=[first_divergence(a, b) for a, b in zip(mine, cached)],
            near_tie_gaps_vs_cached_generate=divergence_gaps(models["ours"][torch.float32], prompts, mine, cached)[0],
            transformers_cached_vs_uncached_identical=sum(a == b for a, b in zip(cached, uncached)))
    figures["distinct_tokens_in_bf16_continuations"] = len({t for c in mine for t in c})
    record("greedy_vs_transformers", of=len(prompts), **figures)
    for dt in ("torch.float32", "torch.bfloat16"):
        assert figures[dt]["identical_vs_uncached"] >= 7
    assert figures["torch.float32"]["identical_vs_cached_generate"] >= 7
    assert all(g < NEAR_TIE for g in figures["torch.bfloat16"]["near_tie_gaps_vs_cached_generate"])


MODES = [(attn, comp, graphs) for attn in ("eager", "sdpa", "triton") for comp in ("none", "step")
         for graphs in (False, True)]
MODE_IDS = [f"{a}-{c}-{'graphs' if g else 'nographs'}" for a, c, g in MODES]
REFERENCE = {}


@torch.no_grad()
def top2_gaps(model32, prompts, runs) -> torch.Tensor:
    """The fp32 logit gap between the best and second-best token at every step of each continuation."""
    gaps = []
    for p, c in zip(prompts, runs):
        logits = model32(torch.tensor([p + c], device="cuda"))[0, len(p) - 1:len(p) + len(c) - 1].float()
        top = logits.topk(2, dim=-1).values                                          # (len(c), 2)
        gaps.append(top[:, 0] - top[:, 1])
    return torch.cat(gaps)


@torch.no_grad()
def logprob_errors(model32, prompts, run, ref_tokens) -> dict:
    """How far a run's numerics are from exact, token by token: |its log-prob - the fp32 model's| for each
    token of the prefix it shares with the reference (teacher-forced, so both score the same context).
    The same figure for the reference itself says whether the engine is any less exact than it."""
    errs, device = [], next(model32.parameters()).device
    for p, c, logp, ref in zip(prompts, run.tokens, run.logprobs, ref_tokens):
        n = first_divergence(c, ref)
        n = len(c) if n is None else n
        if n == 0:
            continue
        logits = model32(torch.tensor([p + c[:n]], device=device))[0, len(p) - 1:len(p) + n - 1]  # (n, V)
        exact = logits.float().log_softmax(-1).gather(-1, torch.tensor(c[:n], device=device)[:, None])[:, 0]
        errs.append((torch.tensor(logp[:n], device=device) - exact).abs())                    # (n,)
    if not errs:  # every run parted from the reference at its first token
        return dict(tokens=0)
    errs = torch.cat(errs)
    return dict(median=round(errs.median().item(), 5), max=round(errs.max().item(), 5), tokens=errs.numel())


def engine_vs_reference(setup, models, dtype, attn, comp, graphs):
    tok, prompts = setup
    ours, ours32 = models["ours"][dtype], models["ours"][torch.float32]
    if dtype not in REFERENCE:
        runs = [generate(ours, [p], NEW, stop_ids=tok.stop_ids, pad_id=tok.pad_id) for p in prompts]
        reference = Rollout([r.tokens[0] for r in runs], [r.logprobs[0] for r in runs])
        ref_err = logprob_errors(ours32, prompts, reference, reference.tokens)
        REFERENCE[dtype] = reference, ref_err
        gaps = top2_gaps(ours32, prompts, reference.tokens)
        record("reference_confidence", weights=WEIGHTS or "random", dtype=str(dtype), steps=gaps.numel(),
               median_top2_gap=round(gaps.median().item(), 4),
               steps_under_near_tie=int((gaps < NEAR_TIE).sum()), steps_under_0_01=int((gaps < 0.01).sum()),
               logprob_err_vs_fp32=ref_err)
    reference, ref_err = REFERENCE[dtype]
    ref = reference.tokens
    engine = Engine(ours.config, EngineConfig(attn=attn, compile=comp, cuda_graphs=graphs, max_batch=8,
                                              max_seq_len=512, kv_pages=512), device="cuda", dtype=dtype)
    engine.load_weights(ours)
    run = engine.generate(prompts, 1, NEW, GREEDY, stop_ids=tok.stop_ids)
    out = run.tokens
    assert engine.kv.num_free == engine.kv.capacity
    same = sum(a == b for a, b in zip(out, ref))
    gaps, spacings = divergence_gaps(ours32, prompts, out, ref)
    err = logprob_errors(ours32, prompts, run, ref)
    record("engine_greedy_vs_reference", weights=WEIGHTS or "random", dtype=str(dtype), attn=attn, compile=comp,
           cuda_graphs=graphs, identical=same, of=len(prompts),
           first_divergence=[first_divergence(a, b) for a, b in zip(out, ref)],
           near_tie_gaps=gaps, bf16_spacing_there=spacings, logprob_err_vs_fp32=err)
    return same, gaps, err, ref_err


@pytest.mark.parametrize("attn, comp, graphs", MODES, ids=MODE_IDS)
@torch.no_grad()
def test_engine_greedy_matches_reference_fp32(setup, models, attn, comp, graphs):
    same, *_ = engine_vs_reference(setup, models, torch.float32, attn, comp, graphs)
    assert same >= 7


@pytest.mark.parametrize("attn, comp, graphs", MODES, ids=MODE_IDS)
@torch.no_grad()
def test_engine_greedy_bf16(setup, models, attn, comp, graphs):
    """Confident (fitted) weights: the same tokens for at least 7 of 8 prompts. Random weights: wherever
    the two part ways, it is at a near tie, the only check their near-uniform logits allow.

    Either way the engine's bf16 log-probs must be about as close to fp32 as the reference's own: a median
    error within 2x of the reference's (+1e-3 for the near-zero errors of confident tokens). Measured on
    the H200 (session 7): engine 0.0073 against 0.0075 on random weights; 6e-5 for both when fitted."""
    same, gaps, err, ref_err = engine_vs_reference(setup, models, torch.bfloat16, attn, comp, graphs)
    if WEIGHTS:
        assert same >= 7
    else:
        assert all(g < NEAR_TIE for g in gaps)
    assert err["tokens"] > 0 and err["median"] <= 2 * ref_err["median"] + 1e-3, (err, ref_err)


@torch.no_grad()
def test_fused_sampler_in_the_compiled_graph_draws_the_reference_samples(setup, models):
    """fp32, plain temperature: the fused Triton sampler inside compile=step + CUDA graphs against the
    eager reference sampler; the same counter-based noise, so the same draws except float-rounding ties."""
    from minigrpo.model.sampling import SamplingParams
    tok, prompts = setup
    ours = models["ours"][torch.float32]
    params, seeds = SamplingParams(temperature=1.0), list(range(100, 100 + 2 * len(prompts)))
    runs = {}
    for name, cfg in (("fused", dict(attn="triton", compile="step", cuda_graphs=True, sampler="triton")),
                      ("reference", dict(attn="sdpa", compile="none", cuda_graphs=False, sampler="torch"))):
        engine = Engine(ours.config, EngineConfig(max_batch=16, max_seq_len=512, kv_pages=1024, **cfg),
                        device="cuda", dtype=torch.float32)
        engine.load_weights(ours)
        runs[name] = engine.generate(prompts, 2, NEW, params, stop_ids=tok.stop_ids, seeds=seeds).tokens
    same = sum(a == b for a, b in zip(runs["fused"], runs["reference"]))
    record("fused_sampler_vs_reference", identical=same, of=len(seeds))
    assert same >= len(seeds) - 1
