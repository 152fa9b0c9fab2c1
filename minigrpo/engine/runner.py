"""Where the engine's graph boundaries live: the per-slot state the decode step reads and writes, and the
runner that turns the step and the prefill into callables under the engine's graph config.

`compile="step"` wraps the decode step (model, sampling and slot bookkeeping) in torch.compile(fullgraph=True), one
graph for all buckets; `cuda_graphs` captures it, compiled or not, per (bucket, sampling params), and the eager prefill
per padded shape. All captured graphs share one memory pool: they never run concurrently, and no output of one is read
after another replays (the step writes the slot state, outside the pool; logits are read at once).

Shape legend: B bucket (batch slots), M block-table width, W output width (max_seq_len + 1), n prompts
in a prefill, T their padded length, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minigrpo.engine.config import EngineConfig
from minigrpo.engine.decode import NO_STOP, DecodeModel, decode_step, decoder_layer
from minigrpo.engine.kv_cache import SCRATCH_PAGE, KVCache
from minigrpo.kernels.decode_attention import choose_num_splits, sm_count
from minigrpo.model.sampling import SamplingParams

MAX_STOPS, STOP_LEN = 16, 4  # stop ids and stop token sequences of up to STOP_LEN tokens, per request


class SlotState:
    """Per-slot decode state, preallocated at full capacity; a bucket of size B uses rows [0, B)."""
    ROWS = ("tok", "pos", "ctr", "seed", "limit", "done", "block_table", "out_tok", "out_logp")  # (B, ...) each,
    # named as `decode_step` names them

    def __init__(self, capacity: int, table_width: int, out_width: int, device):
        def z(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)
        self.tok, self.pos, self.ctr, self.seed, self.limit = (z(capacity) for _ in range(5))  # (B,) each
        self.done = torch.ones(capacity, dtype=torch.bool, device=device)  # empty slots count as done
        self.block_table = z(capacity, table_width, dtype=torch.int32)      # (B, M)
        self.out_tok = z(capacity, out_width)                               # (B, W); column W-1 is scratch
        self.out_logp = z(capacity, out_width, dtype=torch.float32)         # (B, W)
        self.stops = torch.full((MAX_STOPS, STOP_LEN), NO_STOP, dtype=torch.int64, device=device)
        # Host copy of `done`, pinned so the device-to-host copy can run behind the next step.
        self.done_host = torch.ones(capacity, dtype=torch.bool, pin_memory=torch.device(device).type == "cuda")

    def step_args(self, B: int) -> dict[str, torch.Tensor]:
        """The step's state inputs for bucket B, by `decode_step`'s argument names: views of rows [0, B) (the
        addresses CUDA graphs capture), and the stops."""
        return {**{name: getattr(self, name)[:B] for name in self.ROWS}, "stops": self.stops}

    def compact(self, keep: torch.Tensor, n_before: int) -> None:
        """Move rows `keep` to the front; rows after them become empty (done) slots."""
        for name in self.ROWS:
            t = getattr(self, name)
            t[:len(keep)] = t[keep]
        self.done[len(keep):n_before] = True


PREFILL_ALIGN = 32  # captured prefills: prompt length rounded up to this, group count to a power of two


def pad_prefill(ids: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, rows: int, T: int, scratch: int):
    """Pad to (rows, T): extra rows and columns are pad tokens (id 0) at the scratch slot; extra rows have length 1."""
    n, t = ids.shape                                                                # (n, t) -> (rows, T)
    pad = (0, T - t, 0, rows - n)
    return F.pad(ids, pad), F.pad(lens, (0, rows - n), value=1), F.pad(slots, pad, value=scratch)


class StepRunner:
    """The decode step as a callable per (bucket, sampling params), and the prefill, under the graph config."""

    def __init__(self, model: DecodeModel, kv: KVCache, state: SlotState, cfg: EngineConfig):
        self.model, self.kv, self.state, self.cfg = model, kv, state, cfg
        # emulate_precision_casts: each op's output rounds as in eager (Inductor would keep fused intermediates in
        # fp32), so a bf16 greedy rollout does not depend on the compile mode. Static shapes but the batch dimension
        # (StepRunner.step), one compile for all buckets: the Triton attention's split count is the largest bucket's.
        self._step = (torch.compile(decode_step, fullgraph=True, dynamic=False,
                                    options={"emulate_precision_casts": True})
                      if cfg.compile == "step" else decode_step)
        _, S, Hkv, _ = kv.k[0].shape
        self.num_splits = choose_num_splits(cfg.max_batch, Hkv, state.block_table.shape[1] * S,
                                            sm_count(kv.k[0].device))
        self.layer = decoder_layer(model.cfg, cfg.attn, self.num_splits)
        self._prepared: dict = {}  # (bucket, params) -> the step, replaying a graph if captured
        self._prefills: dict = {}  # padded (rows, T) -> (graph, static inputs, box holding its logits)
        self._pool = None          # one memory pool shared by all captured graphs

    def prefill(self, ids: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """DecodeModel.prefill into the engine's pages -> last-token logits (groups, V). Eagerly many small
        launches per layer, bound by the host; with cuda_graphs one replay per padded shape of that same eager
        code. Not compiled: Inductor's fused norms reduce in another order, and the prefill alone picks each
        sequence's first token, so a bf16 near tie would depend on the graph mode."""
        kv = self.kv
        if not self.cfg.cuda_graphs:
            return self.model.prefill(ids, lens, slots, kv.k, kv.v)
        n, t = ids.shape
        rows, T = 1 << (n - 1).bit_length(), min(-(-t // PREFILL_ALIGN) * PREFILL_ALIGN, self.cfg.max_seq_len)
        inputs = pad_prefill(ids, lens, slots, rows, T, SCRATCH_PAGE * kv.page_size)
        if (rows, T) not in self._prefills:
            static, box = tuple(x.clone() for x in inputs), {}

            def fn():
                box["logits"] = self.model.prefill(*static, kv.k, kv.v)
            graph = capture_graph(fn, self._pool)  # its warm-up runs write the same K/V the replay does
            self._pool = graph.pool()
            self._prefills[rows, T] = (graph, static, box)
        graph, static, box = self._prefills[rows, T]
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        return box["logits"][:n]                                                    # (n, V)

    def step(self, B: int, params: SamplingParams):
        """One decode step on slots [0, B), compiled if configured, as a callable of no arguments."""
        cfg, kv, args = self.cfg, self.kv, self.state.step_args(B)
        if cfg.compile == "step":  # the batch dimension symbolic: one compiled step serves every bucket
            for name in SlotState.ROWS:
                torch._dynamo.maybe_mark_dynamic(args[name], 0)  # `maybe`: a bucket of 1 gets a graph of its own
        return lambda: self._step(self.model, self.layer, params, **args, k_pools=kv.k, v_pools=kv.v,
                                  sampler=cfg.sampler)

    def run(self, B: int, params: SamplingParams, n_steps: int) -> None:
        key = (B, params)
        if key not in self._prepared:  # one compile per sampling params; a graph capture per (bucket, params)
            step = self.step(B, params)
            self._prepared[key] = self._capture(step).replay if self.cfg.cuda_graphs else step
        step = self._prepared[key]
        for _ in range(n_steps):
            step()

    def _capture(self, step) -> torch.cuda.CUDAGraph:
        """Capture one step with every slot marked done, so the warm-up steps store nothing and move no
        live sequence (a done slot's state stays as it is, decode.advance); the done mask is restored after."""
        done = self.state.done.clone()
        self.state.done.fill_(True)
        graph = capture_graph(step, self._pool)
        self._pool = graph.pool()
        self.state.done.copy_(done)
        return graph


def capture_graph(fn, pool=None, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Run fn a few times on a side stream (compiling, autotuning, allocating), then capture one call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph
