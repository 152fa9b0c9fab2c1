"""bench/fit_gsm8k.py, the stand-in for trained weights the GPU parity checks run on: the chat it fits
ends with the reference solution and the stop token, a few steps lower the loss, and the sequences to
memorise are learnt."""

import pytest
import torch
from conftest import QWEN_DIR, SHARED_DATA, random_model, tiny_config

from bench.fit_gsm8k import IGNORE, batch, chats, fit
from minigrpo.model.tokenizer import Tokenizer


def test_right_padded_batch_predicts_only_real_tokens():
    ids, tgt = batch([[5, 6, 7], [8, 9]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6], [8, 9]]
    assert tgt.tolist() == [[6, 7], [9, IGNORE]]


def test_chats_hold_prompt_solution_and_stop():
    if not (SHARED_DATA / "gsm8k" / "train.jsonl").is_file():
        pytest.skip(f"no GSM8K data at {SHARED_DATA}")
    tok = Tokenizer.from_dir(QWEN_DIR)
    seqs = chats(tok, SHARED_DATA / "gsm8k" / "train.jsonl", max_len=512)
    text = tok.decode(seqs[0], skip_special_tokens=False)
    assert "<|im_start|>assistant\n" in text and text.rstrip().endswith("#### 72<|im_end|>")
    assert max(len(s) for s in seqs) <= 512


def test_fit_lowers_the_loss():
    torch.manual_seed(0)
    model = random_model(tiny_config(vocab=64))
    toy = [torch.randint(1, 64, (6,)).tolist() * 5 for _ in range(4)]  # repeating: learnable in a few steps
    losses = fit(model, toy, pad_id=0, seconds=float("inf"), steps=40, batch_size=4, lr=3e-3, warmup=4, seed=0,
                 log_every=10)
    assert losses[-1][0] == 40 and not model.training
    assert losses[-1][1] < 0.7 * losses[0][1], losses


def test_memorised_sequences_are_learnt_by_heart():
    """A random sequence that joins every batch is learnt; the same fit without it leaves it unknown."""
    gen = torch.Generator().manual_seed(0)
    noise = [torch.randint(1, 64, (12,), generator=gen).tolist() for _ in range(64)]  # nothing to learn
    target = torch.randint(1, 64, (24,), generator=gen).tolist()
    losses = {}
    for memorize in ([], [target]):
        model = random_model(tiny_config(vocab=64))
        fit(model, noise, pad_id=0, seconds=float("inf"), steps=60, batch_size=4, lr=1e-2, warmup=4, seed=0,
            memorize=memorize, log_every=1000)
        ids, tgt = batch([target], pad_id=0, device="cpu")
        with torch.no_grad():
            losses[len(memorize)] = torch.nn.functional.cross_entropy(model(ids)[0], tgt[0]).item()
    assert losses[1] < 0.3 * losses[0], losses


@pytest.mark.parametrize("args, message", [(["--steps", "0"], "--steps must be positive"),
                                           (["--memorize", "-1"], "--memorize must be >= 0"),
                                           ([], "config.json not found")])
def test_bad_settings_are_named(tmp_path, capsys, args, message):
    from bench.fit_gsm8k import main
    with pytest.raises(SystemExit) as exit_:
        main(["--data", str(tmp_path), "--out", str(tmp_path / "out")] + args)
    assert message in capsys.readouterr().err + str(exit_.value)  # argparse prints; our checks raise the text


def test_pieces_give_the_whole_batch_gradient():
    """accumulate_loss runs 8 rows at a time; its loss and gradient are those of the whole batch at once."""
    from contextlib import nullcontext

    from bench.fit_gsm8k import PIECE_ROWS, accumulate_loss
    torch.manual_seed(0)
    model = random_model(tiny_config(vocab=64))  # fp32: the pieces differ from the whole in summation order only
    pick = [torch.randint(1, 64, (n,)).tolist() for n in torch.randint(3, 12, (2 * PIECE_ROWS + 3,)).tolist()]
    loss = accumulate_loss(model, pick, 0, nullcontext())
    pieces = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ids, tgt = batch(pick, pad_id=0, device="cpu")
    whole = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), tgt.flatten(), ignore_index=IGNORE)
    whole.backward()
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-5, atol=0)  # fp32 sums of ~150 terms: ~1e-6 apart
    for a, p in zip(pieces, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
