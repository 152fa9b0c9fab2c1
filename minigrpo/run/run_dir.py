"""A run's output folder (--out): no command deletes another run's files, or mixes two runs in one folder.

A folder "holds a run" once it has any of RUN_FILES. A new run into it is refused unless it continues that
run (--resume) or moves it aside to `<out>.old-<time>` (--overwrite, which deletes nothing, and moves only a
folder that holds nothing but a run, and not the one the process works in); so is resuming
a checkpoint from elsewhere into it. While a run writes to a folder it holds a lock on it (`locked_out`), so a
second run there (a job requeued while the first still runs) is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import warnings
from pathlib import Path

from minigrpo.run.checkpoints import LATEST, latest_name

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "eval.jsonl", "checkpoints", "tensorboard")


def run_files(out: Path) -> list[str]:
    """The RUN_FILES present in `out`: empty when it holds no run (or does not exist)."""
    return [name for name in RUN_FILES if (out / name).exists()]


def run_owning(path: Path) -> Path | None:
    """The run folder whose own files (RUN_FILES) `path` is, or lies in: only train.py writes there, so another
    command (evaluate.py --out, weights/download.py --out) must not. A folder is a run's when it holds other
    RUN_FILES too, or a run is writing there now; an eval.jsonl alone is an earlier evaluate.py's. None for any
    other path."""
    path = path.resolve()
    for folder in path.parents:
        name = path.relative_to(folder).parts[0]
        if name in RUN_FILES and folder.is_dir() and (set(run_files(folder)) - {name} or _locked(folder)):
            return folder
    return None


def check_out(out: Path, *, resume: str | None, overwrite: bool) -> None:
    """Refuse flags that would delete or mix a run's files, with a message that says what to do instead.
    `resume` is --resume's value: None without the flag, "" for the newest checkpoint in `out`."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"--out {out} lies under {above}, which is a file, not a folder; choose another --out")
    if not out.resolve().name:
        raise ValueError(f"--out {out} is the root folder; choose a folder for the run, e.g. runs/a")
    writes_in = out if out.exists() else above
    if writes_in is not None and not os.access(writes_in, os.W_OK | os.X_OK):  # found now, not after a step
        raise ValueError(f"--out {out}: cannot write in {writes_in}; choose another --out")
    if (out / "config.json").is_file():
        raise ValueError(f"--out {out} is a model directory (it holds config.json); a run writes beside its model, "
                         f"not into it: choose another --out")
    found = run_files(out)
    if found and _locked(out):
        raise ValueError(_busy(out))
    resumes_out = resume == "" or (resume is not None and Path(resume).resolve().is_relative_to(out.resolve()))
    if resume and resumes_out:
        _check_own_checkpoint(out, Path(resume))
    if overwrite and resumes_out:
        raise ValueError("--overwrite moves the run in --out aside, --resume continues it: pass one of them")
    if overwrite and found:
        _check_movable(out)
    if not found or overwrite or resumes_out:
        return
    held = f"--out {out} already holds a run ({', '.join(found)})"
    if resume is None and latest_name(out / "checkpoints") is None:  # stopped before its first checkpoint
        raise ValueError(f"{held} that saved no checkpoint, so it cannot continue; pass --overwrite to move it aside "
                         f"to {out}.old-<time> and start afresh, or choose a new --out")
    if resume is None:
        raise ValueError(f"{held}; add --resume to continue it, choose a new --out, or pass --overwrite to move "
                         f"it aside to {out}.old-<time>")
    raise ValueError(f"{held}; resuming {resume} into it would mix two runs: choose a new --out")


def _check_own_checkpoint(out: Path, resume: Path) -> None:
    """A --resume inside --out names the run, its checkpoints folder or `latest`, or one of its step_N: only these
    rewind the run (loop._rewind) with its later checkpoints and logs set aside. Anything else there, such as an
    abandoned future (checkpoints/abandoned-*/), would cut the logs back and keep nothing."""
    own, path = (out / "checkpoints").resolve(), resume.resolve()
    if path in (out.resolve(), own, own / LATEST) or path.parent == own:
        return
    raise ValueError(f"--resume {resume} lies in --out {out} but is not one of its checkpoints "
                     f"({out / 'checkpoints'}/step_N); to continue from it, copy it out of {out} and resume it "
                     f"into a new --out")


def _check_movable(out: Path) -> None:
    """--overwrite renames the whole folder: refuse when that would carry off more than a run, or the folder this
    process works in (a relative --out would then name the moved folder)."""
    others = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES)
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise ValueError(f"--overwrite would move all of --out {out} aside, and it holds more than a run ({shown}); "
                         f"choose another --out, or move the run's files ({', '.join(RUN_FILES)}) yourself")
    if Path.cwd().resolve().is_relative_to(out.resolve()):
        raise ValueError(f"--overwrite would move --out {out}, the folder you are working in; run from outside it, "
                         f"or choose another --out")


def move_aside(out: Path) -> Path | None:
    """Rename a run folder to `<out>.old-<time>`, never deleting it; None when `out` holds no run."""
    if not run_files(out):
        return None
    out = out.resolve()  # "." has no name to add a suffix to; a link's folder moves, and the link stays
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out.with_name(f"{out.name}.old-{stamp}"), 1
    while aside.exists():
        n += 1
        aside = out.with_name(f"{out.name}.old-{stamp}-{n}")
    os.rename(out, aside)
    return aside


def _busy(out: Path) -> str:
    return f"another process is running in --out {out}; wait for it to end, or choose another --out"


def _try_lock(fd: int, mode: int = fcntl.LOCK_EX) -> bool:
    """Take the lock of the open folder `fd` (exclusive, or fcntl.LOCK_SH) without waiting: False when another
    process holds it exclusively (or, for an exclusive one, at all). OSError where the filesystem takes no locks."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _locked(out: Path) -> bool:
    """Whether another process holds `out`'s lock (locked_out) now."""
    fd = os.open(out, os.O_RDONLY)
    try:
        # Shared: torchrun's ranks probe together and must not see each other. Closing fd releases it.
        return not _try_lock(fd, fcntl.LOCK_SH)
    except OSError:  # a filesystem without locks: locked_out warns
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked_out(out: Path):
    """Hold a lock on `out` (created if needed) while inside: another process holding it is running there, and
    one writing beside it would interleave the two runs' records. Folders created here and left empty (a start
    that failed) are removed on the way out. A symbolic link's folder is created where it points (after
    --overwrite moved the one it named aside)."""
    real = out.resolve()
    created = [p for p in (real, *real.parents) if not p.exists()]  # deepest first
    real.mkdir(parents=True, exist_ok=True)
    fd = os.open(real, os.O_RDONLY)
    try:
        try:
            if not _try_lock(fd):
                raise ValueError(_busy(out))
        except OSError as e:  # a filesystem without locks (Lustre mounted without flock, some FUSE): run unlocked
            warnings.warn(f"--out {out}: its filesystem takes no locks ({e.strerror}); a second run started there "
                          f"while this one runs would not be refused", stacklevel=3)
        yield
    finally:
        os.close(fd)
        for folder in created:
            if not folder.is_dir() or any(folder.iterdir()):
                break
            folder.rmdir()
