"""The rollout engine against the reference generate, and the paged cache's bookkeeping."""

import os
import warnings
from dataclasses import replace

import pytest
import torch
from conftest import random_model, tiny_config

from minigrpo.engine import engine as engine_module
from minigrpo.engine.config import EngineConfig
from minigrpo.engine.decode import decode_step
from minigrpo.engine.engine import Engine
from minigrpo.engine.kv_cache import SCRATCH_PAGE, OutOfPages
from minigrpo.engine.rollout import ReferenceBackend
from minigrpo.engine.runner import pad_prefill
from minigrpo.model.generate import generate
from minigrpo.model.sampling import GREEDY, SamplingParams

CFG = tiny_config(tied=False, head_dim=16)  # the Triton kernel needs head_dim >= 16
STOP = (27, 240)  # greedy: two prompts stop early, one runs to the budget
G = 3


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0, std=0.2)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 16, 23, 9)]


def reference(model, prompts, params=GREEDY, seeds=None, new=20):
    return generate(model, [p for p in prompts for _ in range(G)], new, params=params, stop_ids=STOP, seeds=seeds)


def make_engine(model, **kw):
    cfg = dict(page_size=8, max_batch=16, max_seq_len=64, sync_every=3)
    cfg.update(kw)
    engine = Engine(model.config, EngineConfig(**cfg), device="cpu", dtype=torch.float32)
    engine.load_weights(model)
    return engine


BACKENDS = ["eager", "sdpa"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


@pytest.mark.parametrize("attn", BACKENDS)
def test_greedy_tokens_equal_reference(model, prompts, attn):
    ref = reference(model, prompts)
    assert any(len(t) < 20 for t in ref.tokens) and any(len(t) == 20 for t in ref.tokens)  # stops and budgets
    engine = make_engine(model, attn=attn)
    out = engine.generate(prompts, G, 20, GREEDY, stop_ids=STOP)
    assert out.tokens == ref.tokens
    assert engine.kv.num_free == engine.kv.capacity  # every page back in the pool


@pytest.mark.parametrize("attn", BACKENDS)
def test_sequences_that_fill_max_seq_len_exactly(model, prompts, attn):
    # A prompt plus its budget is exactly max_seq_len: its last fed token sits at the tables' last position and
    # its pages fill the block table, while finished slots keep stepping until the next sync (sync_every).
    prompts = prompts[:2]                                       # 16 + 20 tokens run to the budget
    ref = reference(model, prompts, new=20)
    assert max(len(p) + len(t) for p, t in zip([p for p in prompts for _ in range(G)], ref.tokens)) == 36
    engine = make_engine(model, attn=attn, max_seq_len=36, sync_every=7)
    assert engine.generate(prompts, G, 20, GREEDY, stop_ids=STOP).tokens == ref.tokens


@pytest.mark.parametrize("attn", ["sdpa"])
def test_sampled_tokens_and_logprobs_equal_reference(model, prompts, attn):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50)
    seeds = list(range(100, 100 + len(prompts) * G))
    ref = reference(model, prompts, params, seeds)
    out = make_engine(model, attn=attn).generate(prompts, G, 20, params, stop_ids=STOP, seeds=seeds)
    assert out.tokens == ref.tokens
    diff = max(abs(a - b) for x, y in zip(out.logprobs, ref.logprobs) for a, b in zip(x, y))
    assert diff < 1e-4
    assert len({tuple(t) for t in out.tokens[:G]}) > 1  # samples of one prompt differ


def test_fused_triton_sampler_draws_the_reference_samples(model, prompts):
    # compile=step with Triton ops needs a GPU (Inductor cannot trace the CPU interpreter): tests/test_gpu.py.
    compile_mode = "none"
    params = SamplingParams(temperature=0.8)  # plain temperature: the fused kernel's case
    seeds = list(range(7, 7 + len(prompts) * G))
    ref = reference(model, prompts, params, seeds)
    engine = make_engine(model, attn="sdpa", sampler="triton", compile=compile_mode)
    out = engine.generate(prompts, G, 20, params, stop_ids=STOP, seeds=seeds)
    assert out.tokens == ref.tokens
    diff = max(abs(a - b) for x, y in zip(out.logprobs, ref.logprobs) for a, b in zip(x, y))
    assert diff < 1e-4


def test_group_shares_full_prompt_pages_and_frees_everything(model, prompts):
    engine = make_engine(model, attn="eager")
    S = engine.cfg.page_size
    seen = {}
    real_run = engine.runner.run

    def spy(B, params, n):  # first decode: every group is prefilled, nothing has finished yet
        if not seen:
            table = engine.state.block_table
            used = set(table[:len(prompts) * G].flatten().tolist()) - {SCRATCH_PAGE}
            assert engine.kv.capacity - engine.kv.num_free == len(used)  # each page handed out once, none leaked
            for group, p in enumerate(prompts):
                rows = table[group * G:(group + 1) * G]
                full = p.__len__() // S
                shared = rows[:, :full]
                assert (shared == shared[0]).all()  # the same physical pages in all G block tables
                seen[group] = full
                private = rows[:, full].tolist()     # partial page (or first generated page): one per sample
                assert len(set(private)) == G
        real_run(B, params, n)
    engine.runner.run = spy
    out = engine.generate(prompts, G, 20, GREEDY, stop_ids=STOP)
    assert seen == {0: 0, 1: 2, 2: 2, 3: 1}  # 5, 16, 23, 9 tokens: their full pages of 8
    assert engine.kv.num_free == engine.kv.capacity
    assert out.tokens == reference(model, prompts).tokens


def test_small_budget_admits_groups_in_waves(model, prompts):
    # Room for about one group at a time: later groups wait for finished ones, results are unchanged.
    engine = make_engine(model, attn="sdpa", kv_pages=16)  # 15 usable pages: one group at a time (10-14 each)
    assert engine.generate(prompts, G, 20, GREEDY, stop_ids=STOP).tokens == reference(model, prompts).tokens
    assert engine.kv.num_free == engine.kv.capacity


def test_budget_too_small_for_one_group_is_a_clear_error(model, prompts):
    engine = make_engine(model, attn="sdpa", kv_pages=4)
    with pytest.raises(OutOfPages, match="raise EngineConfig.kv_pages"):
        engine.generate(prompts, G, 20, GREEDY, stop_ids=STOP)
    assert engine.kv.num_free == engine.kv.capacity  # nothing leaked by the failed request


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[[1, 2]], G=1, new=100), "exceeds the engine's max_seq_len 64"),
    (dict(prompts=[[]], G=1, new=4), "every prompt at least one token"),
    (dict(prompts=[[1, 999]], G=1, new=4), r"prompt token ids must be in \[0, 256\)"),
    (dict(prompts=[[1]], G=17, new=4), "samples_per_prompt must be in"),
    (dict(prompts=[[1]], G=2, new=4, seeds=[1]), r"one seed per completion \(2 = 1 prompts x 2 samples\), got 1"),
    (dict(prompts=[[1]], G=1, new=4, stop_ids=(-1,)), r"ids in \[0, 256\)"),  # -1 would match any token
    (dict(prompts=[[1]], G=1, new=4, stop_ids=((3, 256),)), r"ids in \[0, 256\)"),
    (dict(prompts=[[1]], G=1, new=4, stop_ids=27), "stop_ids must be a tuple"),
])
def test_bad_requests(model, kwargs, message):
    engine = make_engine(model)
    with pytest.raises(ValueError, match=message):
        engine.generate(kwargs["prompts"], kwargs["G"], kwargs["new"], GREEDY, stop_ids=kwargs.get("stop_ids", ()),
                        seeds=kwargs.get("seeds"))


def test_the_reference_backend_refuses_an_empty_prompt(model):
    with pytest.raises(ValueError, match="every prompt at least one token"):
        ReferenceBackend(model, pad_id=0).generate([[1], []], 1, 4, GREEDY, (), seeds=[0, 1])


def test_without_seeds_the_reference_backend_draws_as_the_engine_does(model):
    # seeds=None means seeds 0..N-1 for both backends, as the engine documents; the reference once failed on it
    params = SamplingParams(temperature=1.0)
    ref = ReferenceBackend(model, pad_id=0)
    default = ref.generate([[1, 2], [3]], 2, 6, params, (), seeds=None)
    explicit = ref.generate([[1, 2], [3]], 2, 6, params, (), seeds=[0, 1, 2, 3])
    assert default.tokens == explicit.tokens and default.logprobs == explicit.logprobs


def test_bad_engine_config_names_the_field():
    for bad, message in ((dict(page_size=0), "page_size must be a power of two, got 0"),
                         (dict(page_size=12), "page_size must be a power of two, got 12"),
                         (dict(sync_every=0), "sync_every must be >= 1, got 0"),
                         (dict(kv_memory_fraction=0.0), r"kv_memory_fraction must be in \(0, 1\], got 0.0"),
                         (dict(kv_pages=1), "kv_pages must be at least 2")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)


def test_interrupted_rollout_leaves_the_engine_as_it_found_it(model, prompts, monkeypatch):
    # Ctrl-C (or any error) in the middle of a rollout: every reserved page goes back and no slot keeps
    # decoding, so the next rollout on the same engine is the one a fresh engine gives.
    engine = make_engine(model, attn="sdpa", kv_pages=40)  # room for 2 of the 4 groups at a time
    run, calls = engine.runner.run, []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run(*args)
    monkeypatch.setattr(engine.runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, G, 20, GREEDY, stop_ids=STOP)
    assert engine.kv.num_free == engine.kv.capacity
    assert engine.state.done.all()
    monkeypatch.setattr(engine.runner, "run", run)
    assert engine.generate(prompts, G, 20, GREEDY, stop_ids=STOP).tokens == reference(model, prompts).tokens


@pytest.mark.parametrize("attn", ["eager", "sdpa", "triton"])
def test_decode_step_traces_with_zero_graph_breaks(attn):
    layers = 3  # Dynamo inlines a region called only once: layer 0 plus two more show the reuse
    engine = make_engine(random_model(replace(CFG, num_hidden_layers=layers), seed=0, std=0.2), attn=attn)
    sampler = "triton" if attn == "triton" else "torch"
    explain = torch._dynamo.explain(decode_step)(engine.model, engine.runner.layer, SamplingParams(1.0),
                                                  **engine.state.step_args(8), k_pools=engine.kv.k, v_pools=engine.kv.v,
                                                  sampler=sampler)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    # Every layer calls the same two traced regions (decoder_layer's halves), each compiled once, not once per layer;
    # layer 0's first half, which has no residual terms to add, is outside them.
    calls = [n for n in explain.graphs[0].graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 2 * layers - 1 and len({n.args[1] for n in calls}) == 2


@pytest.mark.parametrize("kernel", [dict(attn="triton"), dict(attn="sdpa", sampler="triton")])
def test_a_compiled_step_over_triton_on_the_cpu_is_one_line_at_construction(model, kernel):
    # Inductor cannot compile around Triton's CPU interpreter: refused at once, not deep in the first generate.
    with pytest.raises(ValueError, match="cannot compile Triton kernels run by Triton's CPU interpreter"):
        make_engine(model, compile="step", **kernel)


@pytest.mark.slow
def test_compiled_step_equals_reference_and_compiles_once_for_every_bucket(model, prompts):
    # The batch dimension is dynamic: one graph serves buckets 16 and 8 (with static shapes, one each).
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    engine = make_engine(model, attn="sdpa", compile="step")
    assert engine.generate(prompts, G, 20, GREEDY, stop_ids=STOP).tokens == reference(model, prompts).tokens
    assert sorted({B for B, _ in engine.runner._prepared}) == [8, 16]  # 12 sequences, then fewer than 8
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


def test_padded_prefill_equals_unpadded(model):
    """Captured prefills run at padded shapes (pad_prefill): the real rows' logits and K/V must not change."""
    e = make_engine(model, attn="sdpa")
    g = torch.Generator().manual_seed(1)
    groups, T = 3, 11
    ids = torch.randint(0, 256, (groups, T), generator=g)
    lens = torch.tensor([11, 4, 7])
    slots = torch.arange(groups * T).view(groups, T) + e.cfg.page_size  # page 0 is scratch
    padded = pad_prefill(ids, lens, slots, rows=4, T=16, scratch=0)
    outs = []
    for args in ((ids, lens, slots), padded):
        for pool in (*e.kv.k, *e.kv.v):
            pool.zero_()
        logits = e.model.prefill(*args, e.kv.k, e.kv.v)[:groups]
        outs.append((logits, e.kv.k[1][1:].clone(), e.kv.v[1][1:].clone()))  # every page but scratch
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # fp32: a taller GEMM may block differently
    assert [tuple(x.shape) for x in padded] == [(4, 16), (4,), (4, 16)] and padded[1].tolist() == [11, 4, 7, 1]


def test_engine_shares_the_policys_memory_and_follows_its_updates_without_a_sync(prompts):
    # Shared weights (the policy in the engine's dtype): the policy's parameters live in the engine's fused
    # buffers, so an optimizer step is the engine's too. A private copy instead would sample the old policy.
    policy = random_model(CFG, seed=1, std=0.2)
    engine = make_engine(policy, attn="sdpa")
    weights = [b for name, b in engine.model.named_buffers() if name not in ("cos", "sin")]
    storages = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    assert storages <= {b.untyped_storage().data_ptr() for b in weights}  # every parameter in the engine's memory
    assert sum(p.numel() for p in policy.parameters()) == sum(b.numel() for b in weights)  # no second copy
    a = policy.model.layers[1].self_attn
    assert a.k_proj.weight.data_ptr() == engine.model.layers[1].w_qkv[a.q_proj.out_features].data_ptr()  # fused rows
    assert dict(policy.named_parameters()).keys() == dict(random_model(CFG).named_parameters()).keys()

    params, seeds = SamplingParams(temperature=1.0), list(range(len(prompts) * G))
    before = engine.generate(prompts, G, 8, params, stop_ids=STOP, seeds=seeds)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    policy(torch.tensor([prompts[0]])).logsumexp(-1).mean().backward()
    optimizer.step()
    after = engine.generate(prompts, G, 8, params, stop_ids=STOP, seeds=seeds)  # no load_weights in between
    ref = reference(policy, prompts, params, seeds, new=8)
    assert after.tokens == ref.tokens
    assert max(abs(x - y) for r, s in zip(after.logprobs, ref.logprobs) for x, y in zip(r, s)) < 1e-4
    assert max(abs(x - y) for r, s in zip(after.logprobs, before.logprobs) for x, y in zip(r, s)) > 1e-2


def test_a_policy_in_another_dtype_is_copied_not_shared():
    # fp32 master weights with a bf16 engine, here bf16 with an fp32 one: a cast copy, synced by load_weights.
    policy = random_model(CFG, seed=1, std=0.2, dtype=torch.bfloat16)
    engine = make_engine(policy, attn="sdpa")
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters())
    assert torch.equal(engine.model.layers[0].w_qkv[:CFG.hidden_size],
                       policy.model.layers[0].self_attn.q_proj.weight.float())
    with torch.no_grad():
        policy.model.norm.weight.mul_(2)
    assert not torch.equal(engine.model.norm, policy.model.norm.weight.float())  # a private copy
    engine.load_weights(policy)
    assert torch.equal(engine.model.norm, policy.model.norm.weight.float())


def test_ends_with_stop_matches_whole_sequences_in_the_output_only():
    from minigrpo.engine.decode import ANY_TOKEN, NO_STOP, ends_with_stop

    stops = torch.tensor([[ANY_TOKEN, ANY_TOKEN, ANY_TOKEN, 9],      # a stop id
                          [ANY_TOKEN, 4, 5, 6],                      # 3-token sequences
                          [ANY_TOKEN, 5, 5, 6],
                          [NO_STOP] * 4])                            # an unused row
    out = torch.tensor([[1, 4, 5, 6, 0], [4, 5, 6, 0, 0], [5, 6, 0, 0, 0], [1, 9, 4, 5, 0], [3, 5, 6, 0, 0],
                        [5, 5, 6, 0, 0]])
    ctr = torch.tensor([4, 3, 2, 2, 3, 3])  # tokens written so far in each row
    # row 2 ends with 5, 6 but its output starts there: a sequence never reaches into the prompt (read as
    # column 0 repeated, 5 5 5 6 would match)
    assert ends_with_stop(out, ctr, stops).tolist() == [True, True, False, True, False, True]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_stop_sequences_end_the_engine_where_the_reference_is_cut(model, prompts, attn):
    """Token sequences taken from the reference's own greedy output: the engine stops right after the first
    occurrence of one, which is where cutting the reference's longer completion at it lands."""
    ref = reference(model, prompts)
    long = max(ref.tokens, key=len)
    seqs = (tuple(long[3:5]), tuple(long[8:11]))  # occur in at least one completion, mid-way
    out = make_engine(model, attn=attn).generate(prompts, G, 20, GREEDY, stop_ids=STOP + seqs)

    def cut(tokens):  # after the first occurrence of a sequence, or unchanged
        ends = [k for k in range(1, len(tokens) + 1) if any(tuple(tokens[max(0, k - len(s)):k]) == s for s in seqs)]
        return tokens[:ends[0]] if ends else tokens
    assert out.tokens == [cut(t) for t in ref.tokens]
    assert sum(map(len, out.tokens)) < sum(map(len, ref.tokens))
    with pytest.raises(ValueError, match="token sequences of 1 to 4 tokens"):
        make_engine(model).generate(prompts, G, 20, GREEDY, stop_ids=STOP + ((1, 2, 3, 4, 5),))


@pytest.mark.gpu
def test_a_rollout_waits_for_the_gpu_only_to_read_its_done_mask(prompts, monkeypatch):
    # The fast path (Triton attention and sampler, compiled step, CUDA graphs): between rounds the host admits,
    # collects and compacts slots while the round's last step runs. A synchronising call there (a pageable copy,
    # .item(), `t[index] = scalar`) would idle the GPU at every round. Sync debug mode warns at each; it does not
    # see the done mask's event wait, the one wait a round makes. The final collection (engine._collect) waits
    # once, by design.
    stops = tuple(range(0, 256, 16))  # MAX_STOPS ids: most sequences stop early, in different rounds
    # max_batch 8 holds 2 of the 4 groups (G = 3): the others are admitted while slots decode
    engine = Engine(CFG, EngineConfig(attn="triton", sampler="triton", compile="step", cuda_graphs=True,
                                      page_size=8, max_batch=8, max_seq_len=64, sync_every=4), device="cuda")
    engine.load_weights(random_model(CFG, seed=0, std=0.2, dtype=torch.bfloat16, device="cuda"))
    params, seeds = SamplingParams(temperature=0.9), list(range(len(prompts) * G))

    def rollout():
        return engine.generate(prompts, G, 40, params, stop_ids=stops, seeds=seeds)
    warm = rollout()  # compiles the step and captures each bucket the same rollout meets again
    lengths = [len(t) for t in warm.tokens]
    assert min(lengths) < 36 and len(set(lengths)) > 3, lengths  # slots finish in several rounds, not all at once
    collect = engine_module._collect

    def collect_after_the_rounds(*args):
        torch.cuda.set_sync_debug_mode(0)
        return collect(*args)
    monkeypatch.setattr(engine_module, "_collect", collect_after_the_rounds)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            assert rollout().tokens == warm.tokens
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # Only the sync warnings themselves: setting the mode also warns, once, that it is a prototype feature.
    syncs = sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
                    if "called a synchronizing CUDA operation" in str(w.message)})
    assert not syncs, f"host syncs inside the rounds at {syncs}"
