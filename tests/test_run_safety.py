"""A run's history and last good checkpoint survive any command, crash and interrupt (issue 16).

The interrupt and crash tests run the real train.py in a subprocess, on the smoke preset at a tiny batch
(4 prompts x 4 samples: a step takes tens of milliseconds, a start about four seconds, mostly `import torch`).
"""

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import random_model, tiny_config
from safetensors.torch import load_file

from minigrpo.engine.rollout import ReferenceBackend
from minigrpo.rl.config import TrainConfig
from minigrpo.rl.trainer import Trainer
from minigrpo.run.checkpoints import LATEST, latest_name, load_checkpoint, resolve_checkpoint, save_checkpoint
from minigrpo.run.metrics import LEGEND, DamagedLog, MetricsLogger
from minigrpo.run.run_dir import check_out, locked_out, move_aside
from minigrpo.run.stopping import NonFiniteError
from minigrpo.tasks.synthetic import CharTokenizer, FirstDigitTask, tiny_policy
from minigrpo.tasks.task import prompt_budget

REPO = Path(__file__).resolve().parents[1]
SMALL = ["train.py", "--preset", "smoke", "-B", "4", "-G", "4", "--eval-every", "0", "--sample-every", "0"]
# Keys that measure the machine, not the training: excluded when runs are compared.
_TIMING = ("time_", "tokens_per_s", "peak_mem", "eval_seconds", "examples_per_s")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=_env())


def start(args: list[str], log: Path) -> subprocess.Popen:
    """train.py in the background, its stdout and stderr going to `log` (unbuffered)."""
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=_env())


def wait_for(text: str, log: Path, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Poll `log` until it shows `text`; False if the process ended without showing it."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if proc.poll() is not None:
            return text in log.read_text()
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {text!r} after {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.002)
    return True


def steps(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def latest_step(out: Path) -> int:
    return int((out / "checkpoints" / LATEST).read_text().strip().removeprefix("step_"))


# ------------------------------------------------------------------------------------------ output folders


def test_a_rerun_into_a_used_out_is_refused_and_overwrite_moves_the_old_run_aside(tmp_path):
    out = tmp_path / "run"
    first = run([*SMALL, "--steps", "2", "--out", str(out)])
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.startswith(f"run folder: {out}\n")  # said at the start, not only at the end
    history = (out / "metrics.jsonl").read_text()

    again = run([*SMALL, "--steps", "3", "--out", str(out)])
    assert again.returncode == 2
    assert again.stderr == (f"error: --out {out} already holds a run (metrics.jsonl, checkpoints); add --resume to "
                            f"continue it, choose a new --out, or pass --overwrite to move it aside to "
                            f"{out}.old-<time>\n")
    assert (out / "metrics.jsonl").read_text() == history

    nothing_to_do = run([*SMALL, "--steps", "2", "--out", str(out), "--resume"])
    assert nothing_to_do.returncode == 2
    assert nothing_to_do.stderr.splitlines()[-1] == ("error: the checkpoint is at step 2 and --steps is 2: nothing to "
                                                     "train; pass a larger --steps to continue")

    fresh = run([*SMALL, "--steps", "3", "--out", str(out), "--overwrite"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    [aside] = tmp_path.glob("run.old-*")
    assert f"run folder: {out} (the run that was there is now {aside})" in fresh.stderr
    assert (aside / "metrics.jsonl").read_text() == history and latest_step(aside) == 2
    assert steps(out) == [1, 2, 3]


def test_overwrite_through_a_symbolic_link_moves_its_folder_and_starts_afresh_where_it_points(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    (real / "metrics.jsonl").write_text("{}\n")
    link.symlink_to(real)
    check_out(link, resume=None, overwrite=True)
    aside = move_aside(link)
    with locked_out(link):
        assert link.is_symlink() and link.resolve() == real and list(real.iterdir()) == []
    assert aside.name.startswith("real.old-") and (aside / "metrics.jsonl").read_text() == "{}\n"


def test_an_out_that_cannot_be_written_is_refused_at_start(tmp_path, monkeypatch):
    import minigrpo.run.run_dir as run_dir

    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: Path(path) != tmp_path)  # tmp_path read-only
    with pytest.raises(ValueError, match=f"--out {tmp_path / 'a' / 'b'}: cannot write in {tmp_path}; choose another"):
        check_out(tmp_path / "a" / "b", resume=None, overwrite=False)


def test_out_rules(tmp_path):
    used = tmp_path / "used"
    (used / "checkpoints").mkdir(parents=True)
    check_out(tmp_path / "new", resume=None, overwrite=False)
    check_out(used, resume="", overwrite=False)
    check_out(used, resume=str(used / "checkpoints" / "step_000002"), overwrite=False)
    with pytest.raises(ValueError, match="--overwrite moves the run in --out aside, --resume continues it"):
        check_out(used, resume="", overwrite=True)
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoints\); resuming .*other.* would mix two"):
        check_out(used, resume=str(tmp_path / "other"), overwrite=False)
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoints\) that saved no checkpoint, so it cannot "
                                         r"continue; pass --overwrite to move it aside"):
        check_out(used, resume=None, overwrite=False)  # stopped before its first save: --resume would find nothing
    (used / "checkpoints" / LATEST).write_text("step_000002\n")
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoints\); add --resume to continue it"):
        check_out(used, resume=None, overwrite=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--out .*file is a file, not a folder; choose another --out"):
        check_out(tmp_path / "file", resume=None, overwrite=False)
    with pytest.raises(ValueError, match="--out / is the root folder; choose a folder for the run"):
        check_out(Path("/"), resume=None, overwrite=False)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # --out = --model-dir, say
    with pytest.raises(ValueError, match=r"--out .*model is a model directory \(it holds config.json\)"):
        check_out(tmp_path / "model", resume=None, overwrite=False)


def test_overwrite_moves_only_a_folder_that_holds_nothing_but_a_run(tmp_path, monkeypatch):
    run_only = tmp_path / "run"
    (run_only / "checkpoints").mkdir(parents=True)
    (run_only / "metrics.jsonl").write_text("")
    check_out(run_only, resume=None, overwrite=True)
    project = tmp_path / "project"  # a run written into a folder of other work: --out .
    (project / "checkpoints").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"would move all of --out .*project aside, and it holds more than a run "
                                         r"\(notes.txt\); choose another --out"):
        check_out(project, resume=None, overwrite=True)
    monkeypatch.chdir(run_only / "checkpoints")
    with pytest.raises(ValueError, match=r"would move --out \.\., the folder you are working in"):
        check_out(Path(".."), resume=None, overwrite=True)
    assert (project / "notes.txt").exists() and run_only.exists()


def test_a_fresh_logger_never_deletes_records(tmp_path):
    MetricsLogger(tmp_path, echo=False).log({"step": 1})
    with pytest.raises(FileExistsError, match="metrics.jsonl exists: it holds another run's records"):
        MetricsLogger(tmp_path, echo=False)
    assert steps(tmp_path) == [1]


def test_resume_drops_a_record_that_a_crash_cut_short(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "rew')
    MetricsLogger(tmp_path, resume_step=3, echo=False)
    assert steps(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("line", [b'{"step": 2, "rew', b'{"step": "2"}', b'{"step": null}', b"[2]",
                                  b'{"step": 2, "x": "\xff"}'])  # a complete line: not a crash's cut
def test_resume_over_a_damaged_record_names_its_line_and_keeps_the_file(tmp_path, line):
    text = b'{"step": 1}\n' + line + b'\n{"step": 3}\n'
    (tmp_path / "metrics.jsonl").write_bytes(text)
    with pytest.raises(DamagedLog, match=r"metrics.jsonl:2 is not a JSON record of a step; repair or remove that"):
        MetricsLogger(tmp_path, resume_step=3, echo=False)
    assert (tmp_path / "metrics.jsonl").read_bytes() == text


def test_a_checkpoint_is_on_the_disk_before_its_rename_publishes_it(tmp_path, monkeypatch):
    # A rename only survives a power loss when the data it publishes was flushed first: every file of the
    # checkpoint (and `latest`'s new text) is fsynced before the os.replace that makes it visible.
    events, fsync, replace = [], os.fsync, os.replace

    def recorded_replace(src, dst):  # what the rename publishes: the folder (and all in it) or the file
        events.append(("replace", {str(p) for p in [Path(src), *Path(src).rglob("*")]}))
        return replace(src, dst)
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(os, "replace", recorded_replace)
    save_checkpoint(tmp_path, 1, tiny_policy(13, seed=0), {})
    replaces = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert len(replaces) == 3  # the model folder, the checkpoint folder, latest
    for i in replaces:
        assert events[i][1] <= {p for kind, p in events[:i] if kind == "fsync"}, events[i][1]


# ------------------------------------------------------------------------------------------ checkpoints


def test_pruning_keeps_this_runs_newest_checkpoints_by_step(tmp_path):
    root, model = tmp_path / "checkpoints", tiny_policy(13, seed=0)
    for step in (100, 150):  # a longer run's, before a resume rewound the folder to an earlier step
        save_checkpoint(root, step, model, {})
    for step in (10, 20, 30):
        save_checkpoint(root, step, model, {}, keep=2)
        assert (root / LATEST).read_text() == f"step_{step:06d}\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000020", "step_000030", "step_000100",
                                                       "step_000150"]
    assert resolve_checkpoint(tmp_path) == root / "step_000030"


def test_latest_naming_a_missing_checkpoint_says_so(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, tiny_policy(13, seed=0), {})
    (root / LATEST).write_text("step_000002\n")
    with pytest.raises(FileNotFoundError, match=r"latest names step_000002, which is missing or incomplete"):
        resolve_checkpoint(tmp_path)
    (root / LATEST).write_text("step_000001\n")
    assert resolve_checkpoint(root / LATEST) == root / "step_000001"  # the file named for the one it names
    for name in ("", "../../other/checkpoints/step_000001"):  # another run's checkpoint would be resumed here
        (root / LATEST).write_text(name + "\n")
        with pytest.raises(ValueError, match=r"latest names '.*', not a checkpoint folder of this run"):
            resolve_checkpoint(tmp_path)


def test_resume_into_a_model_of_another_shape_is_one_line(tmp_path):
    save_checkpoint(tmp_path, 1, random_model(tiny_config(layers=2)), {})
    with pytest.raises(ValueError, match=r"its model has another shape than this run's \(checkpoint vs now: "
                                         r"num_hidden_layers 2 vs 3\); resume with the model it was trained from"):
        load_checkpoint(tmp_path, random_model(tiny_config(layers=3)))


def test_weights_with_nan_are_never_saved(tmp_path):
    tokenizer = CharTokenizer()
    model = tiny_policy(tokenizer.vocab_size, seed=0)
    trainer = Trainer(TrainConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=2), model, tokenizer,
                      FirstDigitTask(tokenizer, 8, seed=0), ReferenceBackend(model, tokenizer.pad_id), tmp_path,
                      echo=False)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="step 0: the weights hold NaN or inf"):
        trainer.save()
    assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------------------------------------------ interrupts and crashes


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_saves_and_prints_the_resume_command(tmp_path, sig):
    out, log = tmp_path / "run", tmp_path / "log"
    args = [*SMALL, "--steps", "100000", "--save-every", "1000", "--out", str(out)]
    proc = start(args, log)
    assert wait_for("step 3 |", log, proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig
    text = log.read_text()
    assert "Traceback" not in text and LEGEND in text
    n = latest_step(out)
    assert n >= 3 and steps(out) == list(range(1, n + 1))
    assert text.splitlines()[-1] == (f"{sig.name} at step {n}: saved {out}/checkpoints/step_{n:06d}; resume with: "
                                     f"python {' '.join(args)} --resume")

    stale = [out / "checkpoints" / f".step_{n + 1:06d}.tmp-99999", out / "checkpoints" / f".{LATEST}.tmp-99999"]
    stale[0].mkdir()
    stale[1].write_text("x")
    resumed = run([*SMALL, "--steps", str(n + 2), "--save-every", "1000", "--out", str(out), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {n}" in resumed.stderr and steps(out) == list(range(1, n + 3))
    assert not any(p.exists() for p in stale)  # an interrupted save's leftovers go at the next start


STALL = """
import sys, time, train
step = train.Trainer.step
def stalling(self):  # step 2 stalls mid-step until interrupted: the second Ctrl-C surely lands inside a step
    if self.step_idx == 1:
        print("stalling in step 2", file=sys.stderr, flush=True)
        while True:
            time.sleep(0.01)
    return step(self)
train.Trainer.step = stalling
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    out, log = tmp_path / "run", tmp_path / "log"
    proc = start(["-c", STALL, *SMALL[1:], "--steps", "5", "--save-every", "1", "--out", str(out)], log)
    assert wait_for("stalling in step 2", log, proc)
    proc.send_signal(signal.SIGINT)
    assert wait_for("SIGINT: stopping after this step", log, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    text = log.read_text()
    assert "Traceback" not in text
    assert text.splitlines()[-1].startswith(
        f"stopped at once; the last complete checkpoint is {out}/checkpoints/step_000001; resume with: python ")
    state = torch.load(resolve_checkpoint(out) / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1


SLOW_EVAL = """
import sys, time, train
import minigrpo.rl.loop as loop
evaluate = loop._evaluate
def slow(t, logger):  # the step-0 evaluation takes long enough for a Ctrl-C to land inside it
    print(f"evaluating at step {t.step_idx}", file=sys.stderr, flush=True)
    time.sleep(1.0)
    return evaluate(t, logger)
loop._evaluate = slow
sys.exit(train.main(sys.argv[1:]))
"""


def test_ctrl_c_in_the_first_evaluation_saves_step_0_and_the_run_resumes(tmp_path):
    # The default run evaluates before step 1: a Ctrl-C there saves step 0, and resuming it once made the logger
    # take the run for a fresh one and refuse its own metrics.jsonl.
    out, log = tmp_path / "run", tmp_path / "log"
    args = [*SMALL[1:], "--eval-every", "2", "--eval-limit", "4", "--steps", "3", "--out", str(out)]
    proc = start(["-c", SLOW_EVAL, *args], log)
    assert wait_for("evaluating at step 0", log, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert latest_step(out) == 0 and steps(out) == [0]
    resumed = run([*SMALL[:1], *args, "--resume"])
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert steps(out) == [0, 1, 2, 3]  # step 0's evaluation once: it is not run again


def test_a_refused_resume_changes_nothing(tmp_path):
    out = tmp_path / "run"
    assert run([*SMALL, "--steps", "4", "--save-every", "2", "--out", str(out)]).returncode == 0
    refused = run([*SMALL, "--steps", "2", "--out", str(out), "--resume", str(out / "checkpoints" / "step_000002")])
    assert refused.returncode == 2 and "nothing to train" in refused.stderr.splitlines()[-1]
    assert latest_step(out) == 4 and steps(out) == [1, 2, 3, 4]  # `latest` and the logs as they were
    # a damaged log refuses a rewinding resume before the rewind moves the later checkpoints aside
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join([lines[0], "garbage\n", *lines[2:]]))
    refused = run([*SMALL, "--steps", "4", "--out", str(out), "--resume", str(out / "checkpoints" / "step_000002")])
    assert refused.returncode == 2 and "metrics.jsonl:2 is not a JSON record" in refused.stderr.splitlines()[-1]
    assert latest_step(out) == 4 and not list((out / "checkpoints").glob("abandoned-*"))


def test_a_resume_from_an_earlier_checkpoint_keeps_the_abandoned_future(tmp_path):
    # Rewinding to step 4 of a run that reached step 6: the run goes on from step 4 (its logs cut back to it),
    # and the checkpoint past it and the logs as they were move to checkpoints/abandoned-*/, where pruning and
    # resuming never look: nothing the first run wrote is lost.
    out = tmp_path / "run"
    args = [*SMALL, "--steps", "6", "--save-every", "2", "--keep-checkpoints", "2", "--out", str(out)]
    assert run(args).returncode == 0
    before = load_file(out / "checkpoints" / "step_000006" / "model" / "model.safetensors")
    first_log = (out / "metrics.jsonl").read_text()
    rewound = run([*args, "--resume", str(out / "checkpoints" / "step_000004")])
    assert rewound.returncode == 0, rewound.stderr[-3000:]
    (aside,) = (out / "checkpoints").glob("abandoned-*")
    assert f"the later ones and the logs are kept in {aside}" in rewound.stderr
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_000006"]
    assert (aside / "metrics.jsonl").read_text() == first_log
    kept = load_file(aside / "step_000006" / "model" / "model.safetensors")
    assert all(torch.equal(kept[k], before[k]) for k in before)
    assert steps(out) == [1, 2, 3, 4, 5, 6] and latest_step(out) == 6
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000004", "step_000006"]
    # resuming the abandoned future in place would cut the logs back and keep nothing: refused, nothing changes
    logs = (out / "metrics.jsonl").read_text()
    refused = run([*args, "--steps", "8", "--resume", str(aside / "step_000006")])
    assert refused.returncode == 2 and "is not one of its checkpoints" in refused.stderr.splitlines()[-1]
    assert (out / "metrics.jsonl").read_text() == logs and latest_step(out) == 6
    again = run([*args, "--steps", "8", "--resume"])  # a resume from the newest abandons nothing
    assert again.returncode == 0 and len(list((out / "checkpoints").glob("abandoned-*"))) == 1


def test_a_second_run_into_a_running_out_is_refused(tmp_path):
    # A requeued job started while the first still runs would interleave both runs' records.
    out, log = tmp_path / "run", tmp_path / "log"
    proc = start(["-c", STALL, *SMALL[1:], "--steps", "5", "--save-every", "1", "--out", str(out)], log)
    try:
        assert wait_for("stalling in step 2", log, proc)
        for flags in (["--resume"], [], ["--overwrite"]):  # said first: not "add --resume" or "pass --overwrite"
            second = run([*SMALL, "--steps", "5", "--out", str(out), *flags])
            assert second.returncode == 2 and "Traceback" not in second.stderr
            assert second.stderr.splitlines()[-1] == (f"error: another process is running in --out {out}; wait for "
                                                      f"it to end, or choose another --out")
    finally:
        proc.kill()
        proc.wait()


def test_ranks_probing_a_run_folder_together_do_not_see_each_other(tmp_path):
    # Under torchrun every rank runs check_out at once: one rank's probe of the lock must not read as a run.
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    other = os.open(out, os.O_RDONLY)  # flock locks belong to the open file: this fd is another rank, or run
    try:
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another rank's probe, at this moment
        check_out(out, resume="", overwrite=False)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run holding the folder (locked_out)
        with pytest.raises(ValueError, match="another process is running in --out"):
            check_out(out, resume="", overwrite=False)
    finally:
        os.close(other)


def test_a_start_that_fails_leaves_no_folder_behind(tmp_path):
    # The run folder is created (and locked) before the model loads; a start refused after that removes it.
    proc = run(["train.py", "--model-dir", str(tmp_path / "no_model"), "--out", str(tmp_path / "new" / "run")])
    assert proc.returncode == 2 and "is not a model directory" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "new").exists()


def test_a_filesystem_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    # Lustre mounted without flock answers ENOSYS: refusing to start there would stop every run on it.
    import errno
    import fcntl

    from minigrpo.run.run_dir import locked_out

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="its filesystem takes no locks"):
        with locked_out(tmp_path / "run"):
            (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_unreadable_trainer_state_is_one_line(tmp_path):
    out = tmp_path / "run"
    assert run([*SMALL, "--steps", "1", "--out", str(out)]).returncode == 0
    (out / "checkpoints" / "step_000001" / "trainer_state.pt").write_bytes(b"")  # a save cut short by a full disk
    resumed = run([*SMALL, "--steps", "2", "--out", str(out), "--resume"])
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr
    assert "trainer_state.pt cannot be read" in resumed.stderr.splitlines()[-1]


def test_a_foreign_trainer_state_is_named_in_one_line(tmp_path):
    model = tiny_policy(13, seed=0)
    state = save_checkpoint(tmp_path, 1, model, {}) / "trainer_state.pt"
    state.write_bytes(b"garbage")  # torch's own message goes on to suggest weights_only=False: unsafe, and not ours
    with pytest.raises(ValueError) as e:
        load_checkpoint(tmp_path, model)
    assert "\n" not in str(e.value) and "weights_only" not in str(e.value) and "cannot be read" in str(e.value)
    torch.save({"config": {}, "step": 1}, state)
    with pytest.raises(ValueError, match=r"cannot be read \(KeyError: 'it lacks inputs, optimizer, sampler'\)"):
        load_checkpoint(tmp_path, model)
    torch.save({"config": {}, "optimizer": {}, "sampler": {}, "inputs": {}, "step": "1"}, state)  # edited by hand
    with pytest.raises(ValueError, match=r"cannot be read \(TypeError: its step must be an integer and its config, "):
        load_checkpoint(tmp_path, model)


POISON = """
import sys, torch, train
step = torch.optim.AdamW.step
def poisoned(self, *args, **kwargs):  # the third optimizer step leaves a NaN in the weights
    out = step(self, *args, **kwargs)
    poisoned.calls += 1
    if poisoned.calls == 3:
        self.param_groups[0]["params"][0].data[0, 0] = float("nan")
    return out
poisoned.calls = 0
torch.optim.AdamW.step = poisoned
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_nan_weight_stops_the_run_without_saving_it(tmp_path):
    out = tmp_path / "run"
    proc = run(["-c", POISON, *SMALL[1:], "--steps", "20", "--save-every", "1", "--out", str(out)])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    n = latest_step(out) + 1  # the step that went bad, right after the last saved one
    assert proc.stderr.splitlines()[-1] == (
        f"error: step {n}: the weights hold NaN or inf; this step was not saved, the last complete checkpoint is "
        f"{out}/checkpoints/step_{n - 1:06d}. Lower --lr or --max-grad-norm, or check the data")
    for ckpt in (out / "checkpoints").glob("step_*"):
        assert all(t.isfinite().all() for t in load_file(ckpt / "model" / "model.safetensors").values())


OOM = """
import sys, torch, train
from minigrpo.rl.trainer import Trainer
step = Trainer.step
def short_of_memory(self):  # the third step finds the GPU full
    if self.step_idx == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\\nmore lines")
    return step(self)
Trainer.step = short_of_memory
sys.exit(train.main(sys.argv[1:]))
"""


def test_out_of_memory_mid_run_is_one_line_that_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    proc = run(["-c", OOM, *SMALL[1:], "--steps", "5", "--save-every", "1", "--out", str(out)])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB.); the last complete checkpoint "
        f"is {out}/checkpoints/step_000002. Resume with a smaller --micro-batch-size or --score-batch-size, or "
        f"--activation-checkpointing --recompute-layers auto (memory settings resume the same run, rounded "
        f"differently)")


def _comparable(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(ln).items() if not any(t in k for t in _TIMING)}
            for ln in path.read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_the_uninterrupted_run(tmp_path):
    """20 SIGKILLs, anywhere from start-up to mid-step to mid-checkpoint (every 2 steps), each resumed."""
    args = [*SMALL, "--steps", "100", "--save-every", "2", "--eval-every", "8", "--eval-limit", "8",
            "--sample-every", "3"]
    reference = run([*args, "--out", str(tmp_path / "reference")])
    assert reference.returncode == 0, reference.stderr[-3000:]

    out, log, rng = tmp_path / "killed", tmp_path / "log", random.Random(16)
    killed_after = []  # step lines the killed process had printed
    while len(killed_after) < 20:
        resumable = (out / "checkpoints" / LATEST).is_file()
        proc = start([*args, "--out", str(out), "--resume" if resumable else "--overwrite"], log)
        ahead = rng.randint(0, 3)  # kill within a few steps of the checkpoint it starts from, or at start-up
        marker = f"step {(latest_step(out) if resumable else 0) + ahead} |" if ahead else "run folder:"
        if not wait_for(marker, log, proc):
            break  # the run finished first
        time.sleep(rng.uniform(0, 0.05))
        proc.kill()
        proc.wait()
        killed_after.append(log.read_text().count("\nstep "))
    assert len(killed_after) >= 20 and len(set(killed_after)) >= 4, killed_after  # kills at many moments
    final = run([*args, "--out", str(out), "--resume"])
    assert final.returncode == 0, final.stderr[-3000:]

    assert _comparable(out / "metrics.jsonl") == _comparable(tmp_path / "reference" / "metrics.jsonl")
    assert (out / "samples.jsonl").read_text() == (tmp_path / "reference" / "samples.jsonl").read_text()
    want = load_file(tmp_path / "reference" / "checkpoints" / "step_000100" / "model" / "model.safetensors")
    got = load_file(out / "checkpoints" / "step_000100" / "model" / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not list((out / "checkpoints").glob(".*"))  # no temporary folder survives the final start


# ------------------------------------------------------------------------------------------ prompt budget


class _Prompts:
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def prompt(self, i):
        return [0] * self.lengths[i]

    def describe(self, i):
        return {"source": f"data.jsonl:{i + 1}"}


def test_prompt_budget_defaults_to_the_longest_prompt_used():
    assert prompt_budget([(_Prompts([5, 9, 7]), 3)], max_positions=64, max_new_tokens=8) == 9
    assert prompt_budget([(_Prompts([5, 9, 70]), 2)], max_positions=64, max_new_tokens=8) == 9  # 70 is not used
    assert prompt_budget([(_Prompts([5, 9]), 2)], max_positions=64, max_new_tokens=8, limit=20) == 20


def test_prompts_past_the_models_positions_are_refused():
    with pytest.raises(ValueError, match=r"^2 of 4 prompts are longer than the 56 tokens that the model's 64 "
                                         r"positions leave after 8 new tokens \(longest: 90 tokens, data.jsonl:3\); "
                                         r"remove or shorten them, or lower --max-new-tokens$"):
        prompt_budget([(_Prompts([5, 57, 90, 9]), 4)], max_positions=64, max_new_tokens=8)


def test_prompts_past_max_prompt_tokens_are_refused():
    with pytest.raises(ValueError, match=r"^1 of 2 prompts are longer than --max-prompt-tokens 6 \(longest: 9 "
                                         r"tokens, data.jsonl:2\); remove or shorten them, or raise "
                                         r"--max-prompt-tokens$"):
        prompt_budget([(_Prompts([5, 9]), 2)], max_positions=64, max_new_tokens=8, limit=6)
    with pytest.raises(ValueError, match=r"^2 of 4 prompts \(training and test\) are longer than"):
        prompt_budget([(_Prompts([5, 9]), 2), (_Prompts([9, 5]), 2)], max_positions=64, max_new_tokens=8, limit=6)
    with pytest.raises(ValueError, match=r"--max-prompt-tokens 60 plus 8 new tokens exceeds the model's 64 "
                                         r"positions; use at most 56"):
        prompt_budget([(_Prompts([5]), 1)], max_positions=64, max_new_tokens=8, limit=60)


@pytest.mark.parametrize("fails", ["weights", "state"])
def test_a_failed_checkpoint_write_is_an_os_error_and_leaves_nothing_behind(tmp_path, monkeypatch, fails):
    """A full disk: safetensors and torch.save report it as SafetensorError / RuntimeError, which train.py's one-line
    handler (OSError) would not catch; the half-written folder goes, and `latest` still names the last good step."""
    from safetensors import SafetensorError

    model, root = tiny_policy(13, seed=0), tmp_path / "checkpoints"
    save_checkpoint(root, 1, model, {})

    def full_disk(*args, **kwargs):
        raise (SafetensorError if fails == "weights" else RuntimeError)("unexpected pos 640 vs 512")
    monkeypatch.setattr("minigrpo.model.checkpoint.save_file" if fails == "weights" else "torch.save", full_disk)
    with pytest.raises(OSError, match=r"failed \(unexpected pos 640 vs 512\); its disk has [0-9.]+ GiB free"):
        save_checkpoint(root, 2, model, {})
    assert latest_name(root) == "step_000001" and sorted(p.name for p in root.iterdir()) == [LATEST, "step_000001"]
