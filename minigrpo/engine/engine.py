"""The rollout engine: generates G completions for each of B prompts, fast, with explicit graph boundaries.

    engine = Engine(model_cfg, EngineConfig(attn="triton", compile="step", cuda_graphs=True), device="cuda")
    engine.load_weights(policy)                       # after every optimizer step (free when shared)
    rollout = engine.generate(prompts, samples_per_prompt=8, max_new_tokens=256, params=..., seeds=...)

A rollout runs in rounds. A prompt group is admitted when its worst-case pages fit the KV budget (nothing
is ever evicted) and prefilled once; its G samples share the full prompt pages. Then `sync_every` decode
steps run over a fixed-size bucket of slots with no host involvement (stops and budgets are on-device
masks). At each sync the host reads the done mask (one step stale, so the GPU never waits), returns
finished sequences' pages and compacts the survivors into the smallest bucket that holds them.
`EngineConfig` sets the graph boundaries; `minigrpo/engine/runner.py` is where they are drawn.

Shape legend: N sequences in a rollout (prompts x G), B bucket (batch slots), M block-table width, W output width,
T padded prompt length, V vocabulary; "groups" are the prompts being prefilled, "rows" their G samples' slots.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from minigrpo.engine.config import EngineConfig
from minigrpo.engine.decode import ANY_TOKEN, NO_STOP, DecodeModel, ends_with_stop, sample_tokens
from minigrpo.engine.kv_cache import SCRATCH_PAGE, KVCache, OutOfPages
from minigrpo.engine.runner import MAX_STOPS, STOP_LEN, SlotState, StepRunner
from minigrpo.model.config import ModelConfig
from minigrpo.model.generate import Rollout, check_rollout_request
from minigrpo.model.qwen2 import Qwen2ForCausalLM
from minigrpo.model.sampling import SamplingParams
from minigrpo.model.transfer import to_device


class Engine:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig = EngineConfig(), *,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16):
        device = torch.device(device)
        if cfg.cuda_graphs and device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device; use cuda_graphs=False on the CPU")
        if cfg.compile == "step" and device.type != "cuda" and "triton" in (cfg.attn, cfg.sampler):
            raise ValueError("compile='step' cannot compile Triton kernels run by Triton's CPU interpreter; on the "
                             "CPU use compile='none' with attn or sampler 'triton' (--compile none)")
        self.model_cfg, self.cfg, self.device = model_cfg, cfg, device
        self.model = DecodeModel(model_cfg, dtype, device, max_positions=cfg.max_seq_len)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        pages = cfg.kv_page_count(free, cfg.page_bytes(model_cfg, dtype.itemsize))
        self.kv = KVCache(model_cfg, pages, cfg.page_size, dtype, device)
        self.state = SlotState(cfg.max_batch, cfg.table_width, cfg.max_seq_len + 1, device)
        self.runner = StepRunner(self.model, self.kv, self.state, cfg)
        # marks the done mask's copy to the host each round (on the CPU the copy is synchronous)
        self._done_copied = torch.cuda.Event() if device.type == "cuda" else None

    def load_weights(self, model: Qwen2ForCausalLM) -> None:
        """Generate with the policy's weights from now on: shared or copied in place (DecodeModel.load_from)."""
        self.model.load_from(model)

    def _pages_for(self, prompt_len: int, G: int, max_new: int) -> int:
        """Pages one group holds at most: its shared prompt pages once, each sample's tail G times."""
        shared, tail = page_split(prompt_len, max_new, self.cfg.page_size)
        return shared + G * tail

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], samples_per_prompt: int, max_new_tokens: int,
                 params: SamplingParams, stop_ids: Sequence[int | Sequence[int]] = (),
                 seeds: list[int] | None = None) -> Rollout:
        """G = samples_per_prompt completions of up to max_new_tokens per prompt, group-major (a prompt's samples
        adjacent). A completion ends at its first stop: one of up to MAX_STOPS token ids or token sequences
        of up to STOP_LEN tokens (the stop is kept). seeds: one per completion (default 0, 1, ..., N-1); a
        completion is a pure function of (weights, prompt, seed), whatever else shares its batch."""
        G, st = samples_per_prompt, self.state
        N = len(prompts) * G
        stops = _stop_rows(stop_ids, self.model_cfg.vocab_size)
        self._check_request(prompts, G, max_new_tokens, seeds)
        seeds = list(seeds) if seeds is not None else list(range(N))
        # One stop id or token sequence per row of st.stops, right-aligned (decode.ends_with_stop): one copy.
        st.stops.copy_(to_device(torch.tensor([(ANY_TOKEN,) * (STOP_LEN - len(s)) + s for s in stops]
                                              + [(NO_STOP,) * STOP_LEN] * (MAX_STOPS - len(stops))), self.device))
        seq_pages: dict[int, list[int]] = {}  # pages held by each admitted, unfinished sequence
        try:
            finished_rows = self._decode_all(prompts, G, max_new_tokens, params, seeds, seq_pages)
        except BaseException:  # an error or Ctrl-C mid-rollout: leave no page taken and no slot decoding
            for pages in seq_pages.values():
                self.kv.release(pages)
            st.done.fill_(True)
            raise
        return _collect(finished_rows, N)

    def _decode_all(self, prompts, G, max_new_tokens, params, seeds, seq_pages) -> list[tuple]:
        """The rounds of admission, decoding and collection (module doc) until every sequence has finished.
        -> (sequence ids, lengths, tokens, log-probs) per sync, gathered on the device."""
        cfg, st = self.cfg, self.state
        waiting = deque(range(len(prompts)))
        slot_seq: list[int] = []             # host mirror: sequence id of each live slot, in slot order
        finished_rows = []
        while waiting or slot_seq:
            admitted = self._admit(waiting, prompts, G, max_new_tokens, len(slot_seq), seq_pages)
            if not admitted and not slot_seq:  # every group fits an empty cache (_check_request): pages leaked
                raise OutOfPages(f"nothing decoding, yet only {self.kv.num_free} of {self.kv.capacity} KV pages are "
                                 f"free for the next group")
            if admitted:
                logits = self._prefill(admitted, prompts, G, seq_pages)                    # (groups, V)
                new = [g * G + j for g in admitted for j in range(G)]                      # group-major
                self._start_slots(new, logits.repeat_interleave(G, 0), [len(prompts[s // G]) for s in new],
                                  [seq_pages[s] for s in new], [seeds[s] for s in new], max_new_tokens, params,
                                  first_slot=len(slot_seq))
                slot_seq.extend(new)
            n = len(slot_seq)
            done = self._run_round(next(b for b in cfg.bucket_sizes() if b >= n), n, params)
            finished = [i for i in range(n) if done[i]]
            if finished:
                # Finished slots no longer change (done slots store nothing), so their rows can be gathered
                # behind the step still running, and their pages reused by the next prefill (same stream). The
                # indices are queued copies (to_device), not host syncs that would wait for that step.
                idx = to_device(torch.tensor(finished, dtype=torch.long), self.device)
                finished_rows.append(([slot_seq[i] for i in finished], st.ctr[idx], st.out_tok[idx], st.out_logp[idx]))
                for i in finished:
                    self.kv.release(seq_pages.pop(slot_seq[i]))
                keep = [i for i in range(n) if not done[i]]
                st.compact(to_device(torch.tensor(keep, dtype=torch.long), self.device), n)
                slot_seq = [slot_seq[i] for i in keep]
        return finished_rows

    def _admit(self, waiting: deque, prompts, G: int, max_new: int, live: int, seq_pages: dict) -> list[int]:
        """Take groups from the front of `waiting` while their G slots and worst-case pages fit, reserving each
        one's pages at once (so the next candidate sees what is left). -> the groups admitted."""
        admitted = []
        while waiting and live + G * (len(admitted) + 1) <= self.cfg.max_batch:
            if self._pages_for(len(prompts[waiting[0]]), G, max_new) > self.kv.num_free:
                break
            admitted.append(waiting.popleft())
            seq_pages.update(self._reserve(admitted[-1], len(prompts[admitted[-1]]), G, max_new))
        return admitted

    def _run_round(self, B: int, n: int, params: SamplingParams) -> list[bool]:
        """`sync_every` decode steps on bucket B -> the done mask of the first n slots, one step stale: it is
        copied after the next-to-last step and read while the last runs, so the GPU never idles on this one
        host sync per round. A slot finishing in the last step is collected a round later."""
        st = self.state
        self.runner.run(B, params, self.cfg.sync_every - 1)
        st.done_host[:n].copy_(st.done[:n], non_blocking=True)
        if self._done_copied is not None:
            self._done_copied.record()
        self.runner.run(B, params, 1)
        if self._done_copied is not None:
            self._done_copied.synchronize()
        return st.done_host[:n].tolist()

    def _check_request(self, prompts, G, max_new_tokens, seeds) -> None:
        """One-line errors for a request the engine cannot serve (the stops: _stop_rows)."""
        check_rollout_request(prompts, G, seeds)
        if G < 1 or G > self.cfg.max_batch:
            raise ValueError(f"samples_per_prompt must be in [1, max_batch={self.cfg.max_batch}], got {G}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the engine's "
                             f"max_seq_len {self.cfg.max_seq_len}; raise EngineConfig.max_seq_len")
        vocab = self.model_cfg.vocab_size
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        need, prompt_len = max((self._pages_for(len(p), G, max_new_tokens), len(p)) for p in prompts)
        if need > self.kv.capacity:  # checked now, not after decoding every group that does fit
            raise OutOfPages(f"one prompt group needs {need} KV pages (prompt {prompt_len} tokens, {G} samples x "
                             f"{max_new_tokens} new) but the cache has {self.kv.capacity}; raise "
                             f"EngineConfig.kv_pages / kv_memory_fraction or lower max_new_tokens")

    def _reserve(self, group: int, prompt_len: int, G: int, max_new: int) -> dict[int, list[int]]:
        """Pages for one group: the full prompt pages shared G ways, then each sample's private tail."""
        n_shared, tail = page_split(prompt_len, max_new, self.cfg.page_size)
        shared = self.kv.alloc(n_shared, holders=G)
        return {group * G + j: shared + self.kv.alloc(tail) for j in range(G)}

    def _prefill(self, groups: list[int], prompts, G: int, seq_pages: dict) -> torch.Tensor:
        """Prefill each admitted prompt once into its pages and fan its partial last page out to its G samples'
        own pages. -> the last prompt token's logits (groups, V)."""
        S, dev = self.cfg.page_size, self.device
        lens = [len(prompts[g]) for g in groups]
        ids = pad_sequence([torch.tensor(prompts[g]) for g in groups], batch_first=True)  # (groups, T), pad id 0
        slots = torch.full_like(ids, SCRATCH_PAGE * S)                                 # pads write to scratch
        for r, g in enumerate(groups):
            t = torch.arange(lens[r])                    # sample 0 holds the partial page during prefill
            slots[r, :lens[r]] = torch.tensor(seq_pages[g * G])[t // S] * S + t % S
        logits = self.runner.prefill(*(to_device(t, dev) for t in (ids, torch.tensor(lens), slots)))  # (groups, V)
        partial = [(g, n // S) for g, n in zip(groups, lens) if n % S]  # partial prompt pages: sample 0's to 1..G-1
        self.kv.copy_pages([seq_pages[g * G][i] for g, i in partial for _ in range(1, G)],
                           [seq_pages[g * G + j][i] for g, i in partial for j in range(1, G)])
        return logits

    def _start_slots(self, seq_ids: list[int], logits: torch.Tensor, prompt_lens: list[int], pages: list[list[int]],
                     seeds: list[int], max_new: int, params: SamplingParams, first_slot: int) -> None:
        """Sample each new sequence's first token from its prompt's logits (rows, V) and write its slot's state
        into the rows after the live slots, [first_slot, first_slot + rows)."""
        st, dev = self.state, self.device
        # A slice, not an index tensor: `t[index] = scalar` would copy the scalar to the GPU, a host sync.
        rows = slice(first_slot, first_slot + len(seq_ids))
        seed = to_device(torch.tensor(seeds, dtype=torch.int64), dev)
        first, first_logp = sample_tokens(logits, params, seed, torch.zeros_like(seed), self.cfg.sampler)
        M = st.block_table.shape[1]  # one tensor for all the new rows, not one per sequence (host time)
        table = torch.tensor([p + [SCRATCH_PAGE] * (M - len(p)) for p in pages], dtype=torch.int32)  # (rows, M)
        st.tok[rows] = first
        st.pos[rows] = to_device(torch.tensor(prompt_lens), dev)
        st.ctr[rows] = 1
        st.seed[rows] = seed
        st.limit[rows] = max_new
        st.block_table[rows] = to_device(table, dev)
        st.out_tok[rows, 0] = first
        st.out_logp[rows, 0] = first_logp
        st.done[rows] = ends_with_stop(st.out_tok[rows], st.ctr[rows], st.stops) | (max_new <= 1)


def _collect(finished_rows: list[tuple], N: int) -> Rollout:
    """The rows gathered at each sync -> the rollout's N completions in sequence order: the one host sync of a
    rollout that waits for the GPU to finish (the rounds' done-mask reads wait for one step only)."""
    tokens: list[list[int] | None] = [None] * N
    logprobs: list[list[float] | None] = [None] * N
    for seqs, lens, rows_tok, rows_logp in finished_rows:
        lens = lens.tolist()
        w = max(lens)  # rows are W = max_seq_len + 1 wide; convert only the columns in use
        for seq, n_tok, row_tok, row_logp in zip(seqs, lens, rows_tok[:, :w].tolist(), rows_logp[:, :w].tolist()):
            tokens[seq], logprobs[seq] = row_tok[:n_tok], row_logp[:n_tok]
    return Rollout(tokens, logprobs)


def _stop_rows(stop_ids, vocab: int) -> list[tuple[int, ...]]:
    """stop_ids -> one token tuple per stop (an id is a 1-token sequence), or a one-line error."""
    def as_row(s):
        return (s,) if isinstance(s, int) else tuple(s) if isinstance(s, (list, tuple)) else ()

    def valid(r):
        return 0 < len(r) <= STOP_LEN and all(isinstance(t, int) and 0 <= t < vocab for t in r)
    rows = [as_row(s) for s in stop_ids] if isinstance(stop_ids, (list, tuple)) else None
    if rows is None or len(rows) > MAX_STOPS or not all(map(valid, rows)):
        raise ValueError(f"stop_ids must be a tuple of at most {MAX_STOPS} token ids or token sequences of 1 to "
                         f"{STOP_LEN} tokens, ids in [0, {vocab}); got {stop_ids!r}")
    return rows


def page_split(prompt_len: int, max_new: int, S: int) -> tuple[int, int]:
    """-> (the prompt's full pages, shared by a group's samples; each sample's own pages): the partial last
    prompt page (copied to each sample) and room for max_new tokens after it."""
    return prompt_len // S, math.ceil((prompt_len % S + max_new) / S)
