"""The learning check's pieces (bench/learn.py): the copy task's reward, steps-to-target, the pass rule."""

import pytest

from bench import learn
from minigrpo.tasks.synthetic import CharTokenizer, CopyTask


def test_copy_task_gives_credit_per_position_and_full_marks_only_for_the_exact_answer():
    tok = CharTokenizer()
    task = CopyTask(tok, 4, seed=0, num_digits=3)
    digits = task.digits[0]
    answer = tok.encode(digits) + [tok.eos_id]
    assert task.score(0, answer) == (1.0, True)
    assert task.score(0, answer[:3]) == (0.75, False)                          # no stop: 3 of 4 positions
    assert task.score(0, answer[:3] + [tok.encode("=")[0]] * 4) == (3 / 7, False)  # babbling on costs credit
    wrong = tok.encode(str((int(digits[0]) + 1) % 10)) + answer[1:]
    assert task.score(0, wrong) == (0.75, False)
    assert task.describe(0) == {"question": digits + "=", "ground_truth": digits}


def test_steps_to_target_is_the_first_full_window_at_the_target():
    rewards = [0.0] * 5 + [0.85] * learn.WINDOW + [0.0]  # 9 steps at 0.85 and one at 0 average 0.765
    assert learn.steps_to_target(rewards) == 5 + learn.WINDOW
    assert learn.steps_to_target([0.9] * (learn.WINDOW - 1)) is None  # no full window yet


@pytest.mark.parametrize("hit, failures", [
    ({"fast": 100, "reference": 120, "no-sync": None}, 0),
    ({"fast": 100, "reference": 151, "no-sync": None}, 1),   # too far apart
    ({"fast": None, "reference": 120, "no-sync": None}, 1),  # the fast path never learns
    ({"fast": 100, "reference": 120, "no-sync": 130}, 1),    # the check would miss a broken sync
])
def test_check_passes_only_when_both_learn_alike_and_no_sync_does_not(hit, failures):
    assert len(learn.check(hit)) == failures


def test_a_run_without_sync_keeps_sampling_the_initial_policy(tmp_path):
    flags = ["--device", "cpu", "--steps", "3", "--lr", "1e-1", *learn.ENGINE_FLAGS["cpu"]]
    synced = learn.train_curve(flags + ["--out", str(tmp_path / "a")], sync=True)
    frozen = learn.train_curve(flags + ["--out", str(tmp_path / "b")], sync=False)
    assert synced[0] == frozen[0] and synced[1:] != frozen[1:]  # same first rollout; then only one moves on
