"""Why a run stops before its last step, and how it stops without losing anything.

SIGINT (Ctrl-C) and SIGTERM (how clusters preempt jobs): `StopSignals` turns the first one into a flag, so that
the loop finishes the step, saves a checkpoint and raises `Interrupted`; a second one acts at once, leaving
the last complete checkpoint as it was. A step whose loss or weights are NaN or inf raises `NonFiniteError`
before anything saves those weights.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from pathlib import Path

import torch


class Interrupted(Exception):
    """The run stopped on a signal after saving `checkpoint` at `step`."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        super().__init__(f"{signal.Signals(signum).name} at step {step}; saved {checkpoint}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class NonFiniteError(RuntimeError):
    """A step produced NaN or inf (`what`); its weights were not saved."""

    def __init__(self, step: int, what: str):
        super().__init__(f"step {step}: {what}")


def nonfinite(model: torch.nn.Module, record: dict | None = None) -> str | None:
    """What is NaN or inf after a step, the loss in `record` or the weights, or None when all is finite."""
    loss = (record or {}).get("loss")
    if loss is not None and not math.isfinite(loss):
        return f"the loss is {loss}"
    if not torch.stack([p.isfinite().all() for p in model.parameters()]).all():
        return "the weights hold NaN or inf"
    return None


class StopSignals:
    """Within `with StopSignals() as s:`, the first SIGINT / SIGTERM only sets `s.received` (its number).
    Handlers can be installed only from the main thread; elsewhere signals keep their usual effect."""

    def __init__(self, announce: bool = True):
        self.received: int | None = None
        self.announce = announce  # say on stderr what the first signal does (one rank of several says it)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        self.received = signum
        # A second signal acts at once: Ctrl-C raises KeyboardInterrupt, SIGTERM ends the process. Not the
        # handlers from before: a background job inherits SIGINT ignored, and would ignore the second Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # os.write, not print: the signal may have interrupted a print to the same stream.
        if self.announce:
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step to save a checkpoint "
                        f"(Ctrl-C again stops at once; the last complete checkpoint is kept)\n".encode())
