"""The packed training layout (model/packing.py): rows that share a prompt hold one copy of it, and each token
computes what it computes in its row alone, forward and backward."""

import pytest
import torch
from conftest import random_model, tiny_config

from minigrpo.model.packing import pack
from minigrpo.rl.sequences import SequenceBatch, completion_logprobs

STOP, PAD = 31, 0


def test_packing_layout_hand_made():
    # rows 0 and 1 share prompt [1, 2]: one copy of it, then both completions; row 2's prompt [3] follows
    p = pack([[1, 2], [1, 2], [3]], [[4, STOP], [5], [6, 7, 8]], pad_id=PAD, device="cpu")
    assert p.ids.tolist() == [[1, 2, 4, STOP, 5, 3, 6, 7, 8] + [PAD] * 7]   # 9 tokens -> 16: aligned
    assert p.positions.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3] + list(range(7))]  # completions continue their prompt
    assert p.prompt_ends == [1, 1, 5] and p.starts == [2, 4, 6]
    r = p.rows  # each row gathers its prompt's copy and its completion; the padding is a row of its own; L = 8
    assert r.tokens[:, :4].tolist() == [[0, 1, 2, 3], [0, 1, 4, 11], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert r.tokens.shape == (4, 8) and len(set(r.tokens[1, 3:].tolist())) == 5  # padding slots: spread, not one token
    # each token's output comes from one row that holds it: the shared prompt's from row 0
    assert r.slots.tolist() == [0, 1, 2, 3, 10, 16, 17, 18, 19] + list(range(24, 31))


@pytest.mark.parametrize("seed", range(4))
def test_every_random_packing_lays_out_each_row_whole(seed):
    # rows drawn with repeated, interleaved and prefix-sharing prompts, empty completions, one row alone
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n, hi=9: torch.randint(1, hi, (n,), generator=gen).tolist()  # noqa: E731
    for _ in range(50):
        shared = [draw(int(draw(1, 6)[0])) for _ in range(3)]
        shared.append(shared[0] + draw(2))
        n = int(draw(1, 9)[0])
        prompts = [shared[i - 1] for i in draw(n, 5)]
        completions = [draw(int(k) - 1) for k in draw(n, 6)]
        p = pack(prompts, completions, pad_id=PAD, device="cpu")
        T, (n_rows, L) = p.ids.shape[1], p.rows.tokens.shape
        real = sum(map(len, completions)) + sum(len(q) for q in {tuple(q) for q in prompts})
        assert T % 8 == 0 and 0 <= T - real <= 8 and L % 8 == 0
        assert n_rows == n + (T > real) and (n > 1 or T > real)  # padding: a row of its own, always for one row
        assert torch.equal(p.rows.tokens.flatten()[p.rows.slots], torch.arange(T))  # each token in one slot
        for i, (q, c) in enumerate(zip(prompts, completions)):
            at = p.rows.tokens[i, :len(q) + len(c)]
            assert p.ids[0, at].tolist() == q + c and p.positions[0, at].tolist() == list(range(len(q) + len(c)))
            assert p.ids[0, p.prompt_ends[i]] == q[-1] and (not c or p.starts[i] == at[len(q)])
    with pytest.raises(ValueError, match="every prompt must hold a token"):
        pack([[1], []], [[2], [3]], pad_id=PAD, device="cpu")


def test_sequence_batch_scores_each_token_from_the_state_before_it_in_its_row():
    batch = SequenceBatch.build([[1, 2], [1, 2], [3]], [[4, STOP], [5], [6, 7, 8]], pad_id=PAD, device="cpu")
    assert batch.mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    p = batch.pack()
    rows, j, col, token = batch.scored(p).tolist()
    assert rows == [0, 0, 1, 2, 2, 2] and j == [0, 1, 0, 0, 1, 2]
    assert col == [1, 2, 1, 5, 6, 7]  # a prompt's last token scores the first completion token of each of its rows
    assert p.ids[0, token].tolist() == [4, STOP, 5, 6, 7, 8]
    sub = batch.select([1])
    assert sub.prompts == [[1, 2]] and sub.completions == [[5]] and sub.mask.tolist() == [[1]]


def _rows():
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(1, 60, (n,), generator=gen).tolist()  # noqa: E731
    prompts = [tokens(5)] * 3 + [tokens(2)] * 2 + [tokens(9)]
    return prompts, [tokens(n) for n in (3, 1, 11, 2, 4, 6)]


def test_packed_hidden_states_equal_each_row_alone():
    # fp64 matmuls, but RMSNorm's statistics are fp32 whatever the dtype (as HF's): the packed forward and the
    # row's own agree to a few fp32 ulps. A token that saw another row's completion, or a shifted position, would
    # be off by O(1).
    model = random_model(tiny_config(tied=False, vocab=64), seed=1, std=0.3, dtype=torch.float64)
    prompts, completions = _rows()
    p = pack(prompts, completions, pad_id=PAD, device="cpu")
    packed = model.hidden_states(p.ids, packed=p)[0]                                      # (T, C)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        alone = model.hidden_states(torch.tensor([prompt + completion]))[0]                 # (P + c, C)
        got = torch.cat([packed[p.prompt_ends[i] - len(prompt) + 1:p.prompt_ends[i] + 1],
                         packed[p.starts[i]:p.starts[i] + len(completion)]])
        torch.testing.assert_close(got, alone, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("recompute", [0, 1])
def test_packed_logprob_gradients_equal_the_rows_alone(recompute):
    # the gradient sums a shared prompt's share from every row that attends to it
    model = random_model(tiny_config(tied=True, vocab=64), seed=2, std=0.3, dtype=torch.float64).train()
    prompts, completions = _rows()
    weights = torch.randn(len(prompts), max(map(len, completions)), dtype=torch.float64)  # (n, C)
    batch = SequenceBatch.build(prompts, completions, pad_id=PAD, device="cpu")
    logp = completion_logprobs(model, batch, temperature=0.7, recompute_layers=recompute)
    (logp * weights).sum().backward()
    packed = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    total = 0
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        logits = model(torch.tensor([prompt + completion]))[0, len(prompt) - 1:-1] / 0.7    # (c, V)
        row = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(1)
        torch.testing.assert_close(logp[i, :len(completion)], row.detach(), atol=1e-6, rtol=1e-6)
        total = total + (row * weights[i, :len(completion)]).sum()
    total.backward()
    for n, q in model.named_parameters():  # each within a few fp32 ulps of its largest entry (the norms, above)
        torch.testing.assert_close(packed[n], q.grad, atol=1e-6 * q.grad.abs().max().item(), rtol=0, msg=n)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_layers_serve_every_packing_with_one_graph_per_grad_mode(device):
    # Every size of a packing (tokens, rows, the longest row) is dynamic: a run compiles its
    # decoder layer once per grad mode, whatever its micro-batches hold (8-12 s per graph at 0.5B on the H200).
    # On the CPU Dynamo alone (the eager backend); on CUDA Inductor too, as the trainer compiles, in bf16.
    import torch._dynamo

    from minigrpo.rl.compile_layers import layer_options

    torch._dynamo.reset()
    model = random_model(tiny_config(head_dim=64), seed=0, device=device,
                         dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    for layer in model.model.layers:
        layer.compile(**({"options": layer_options()} if device == "cuda" else {"backend": "eager"}))
    counters = torch._dynamo.utils.counters["stats"]
    graphs = counters["unique_graphs"]
    gen = torch.Generator().manual_seed(0)
    packings = []
    for rows, prompt, completion in ((2, 5, 3), (3, 9, 17), (7, 4, 8), (4, 17, 2), (6, 6, 30)):
        prompts = [torch.randint(1, 250, (prompt + r % 3,), generator=gen).tolist() for r in range(rows)]
        completions = [torch.randint(1, 250, (completion + r,), generator=gen).tolist() for r in range(rows)]
        packings.append(pack(prompts[:1] * 2 + prompts[2:], completions, pad_id=PAD, device=device))
    packings.append(pack([[1, 2, 3, 4, 5]], [[6, 7, 8]], pad_id=PAD, device=device))  # one row of 8: a pad row too
    with torch.no_grad():
        for p in packings:
            model.hidden_states(p.ids, packed=p)
    assert counters["unique_graphs"] - graphs == 1
    for p in packings:  # with grad and activation checkpointing: one more graph
        model.hidden_states(p.ids, packed=p, recompute_layers=2).sum().backward()
    assert counters["unique_graphs"] - graphs == 2
    torch._dynamo.reset()


@pytest.mark.gpu
def test_a_training_micro_batch_never_waits_for_the_gpu():
    # Selecting, packing and copying a micro-batch, its forward and backward queue behind the GPU's work: a host sync
    # there (a pageable copy, .item()) would drain the queue at every micro-batch (model/transfer.py)
    from minigrpo.rl.compile_layers import layer_options

    model = random_model(tiny_config(head_dim=64), seed=0, device="cuda", dtype=torch.bfloat16).train()
    for layer in model.model.layers:
        layer.compile(options=layer_options())
    prompts, completions = _rows()
    batch = SequenceBatch.build(prompts, completions, pad_id=PAD, device="cuda")

    def micro_batch():
        mb = batch.select([0, 1, 3])
        completion_logprobs(model, mb, temperature=0.7, chunk_size=4, recompute_layers=1).sum().backward()

    micro_batch()  # compiles, and pins the host buffers the copies reuse
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        micro_batch()
    finally:
        torch.cuda.set_sync_debug_mode(0)
