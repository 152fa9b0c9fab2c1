"""Command-line plumbing shared by train.py, evaluate.py and weights/download.py: bad input is one line."""

from __future__ import annotations

import argparse

import torch


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one line: the usage of this many flags, printed first, would bury it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (all flags: --help)\n")


def parse_device(parser: argparse.ArgumentParser, text: str) -> torch.device:
    """--device's value as a torch device this machine has, or the parser's one-line error."""
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"--device {text}: not a torch device; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {text}: minigrpo runs on cpu or cuda; use --device cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text}: CUDA is not available here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s); use cuda:0 to "
                     f"cuda:{torch.cuda.device_count() - 1}")
    return device
