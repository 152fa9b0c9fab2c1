"""The trainer's compiled decoder layers: Inductor's options for them, and Dynamo told to fail, not fall back to
eager, past the graphs they should need (Trainer compiles them with --compile-policy)."""

import torch

RECOMPILE_LIMIT = 32  # graphs one compiled decoder layer may need before that is an error (fail_past_recompile_limit)
# Inductor fuses a norm's two backward reductions (over rows, over columns) above a size and by default guards on it:
# a graph more whenever a micro-batch crosses B x T x C = 5 x 2^20. Non-strict mode, where torch has it: no such guard.
_NON_STRICT = "mix_order_reduction_non_strict_mode"


def layer_options() -> dict:
    """Inductor's options for a decoder layer. Its config is imported here, not at the top: ~1 s of start-up that
    an uncompiled run (the CPU's, a refused command line) never uses."""
    import torch._inductor.config

    return {f"triton.{_NON_STRICT}": True} if hasattr(torch._inductor.config.triton, _NON_STRICT) else {}


def fail_past_recompile_limit() -> None:
    """Make Dynamo raise, not silently fall back to eager, if a decoder layer needs more graphs than its grad
    modes and a few shape guards. Process-wide: it also covers the engine's compiled step."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, RECOMPILE_LIMIT)
    cfg.fail_on_recompile_limit_hit = True


def compile_layers(models: list) -> None:
    """Fuses each decoder layer's ~50 small elementwise kernels. Parameters are graph inputs, so one compile serves
    every layer of every model; the packed tokens and rows are dynamic sizes (Qwen2ForCausalLM.hidden_states): one
    graph per grad mode (two with grad when only some layers recompute). nn.Module.compile keeps the state-dict
    names."""
    options = layer_options()
    for m in models:
        for layer in m.model.layers:
            layer.compile(options=options)
    fail_past_recompile_limit()
