"""What a command may overwrite: one rule for every file and directory higgs-trt writes.

- A file (wav, npy, json): a new path, or an existing regular file, which is replaced whole.
- A directory (engine directory, `compare --save`, a random checkpoint): a new path, an empty directory, or a
  directory holding only what that kind of command makes (an engine directory: a higgs-trt manifest.json and its
  files), replaced whole. Rebuilding an engine needs no --force; a directory with anything else in it is refused.
- Never an input of the same command, nor a path inside an input directory (the checkpoint, the engine), nor
  (for a directory) one that contains an input; nor a path inside any engine directory or checkpoint, an input or
  not (their files are checked whole: one written among them breaks them).
- Only where this process can create files: checked by making (and removing) one there before any work, since
  access() says yes to root everywhere (/proc included) and a name may be too long only with our temp suffix.
- Symlinks are followed: the rule applies to the path the link names, which is what gets replaced (the link
  stays a link); a link that names nothing is refused.
Anything else (a directory where a file goes, a device, a fifo, a socket, a mount point where a directory goes: it
cannot be renamed) is refused with one line naming it.

Nothing is ever partial under its final name: a file is written beside its target as
`.NAME.higgs-trt-partial.PID.RANDOM` and renamed over it; a directory is built in
`.NAME.higgs-trt-staging.PID.RANDOM` and swapped in (the replaced one passes through `.NAME.higgs-trt-old.…`).
Such names left by a killed process (its PID gone) are removed by the next write of the same NAME.
"""

import errno
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .errors import HiggsError
from .inputs import kind_of

TAG = "higgs-trt"
WRITE_FAILURES = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a full disk, a file-size limit, a quota
KINDS = ("partial", "staging", "old")
LIST_LIMIT = 5
NAME_MAX = 255  # bytes in one path component (Linux file systems)
CHECKPOINT_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # builder/checkpoint.py's two layouts


def _names(items) -> str:
    items = sorted(items)
    return ", ".join(items[:LIST_LIMIT]) + (f" and {len(items) - LIST_LIMIT} more" if len(items) > LIST_LIMIT else "")


def _resolve(path: Path) -> Path:
    """`path` with every symlink followed; a dangling link is refused."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise HiggsError(f"{path}: is a symlink to nothing ({os.readlink(path)}); give a real path")
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop on the way
        raise HiggsError(f"{path}: cannot be resolved ({e})") from None


def _check_inputs(path: Path, target: Path, inputs, directory: bool) -> None:
    for given in inputs:
        if given is None:
            continue
        source = _resolve(Path(given))
        if target == source or _same_file(target, source):  # also through a hard link
            raise HiggsError(f"{path}: is an input of this command ({given}); write somewhere else")
        if source in target.parents:
            raise HiggsError(f"{path}: lies inside {given}, an input of this command; write somewhere else")
        if directory and target in source.parents:
            raise HiggsError(f"{path}: contains {given}, an input of this command; write somewhere else")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _check_model_dirs(path: Path, target: Path) -> None:
    for parent in target.parents:
        what = _model_dir(parent)
        if what:
            raise HiggsError(f"{path}: lies inside {parent}, {what}; write somewhere else")


def _model_dir(directory: Path) -> str | None:
    """'an engine directory' or 'a checkpoint' where `directory` is one, else None."""
    if _engine_listing(directory) is not None:
        return "an engine directory"
    if (directory / "config.json").is_file() and any((directory / name).is_file() for name in CHECKPOINT_WEIGHTS):
        return "a checkpoint"
    return None


def _probe(path: Path, directory: Path, target: Path, kind: str) -> None:
    """Make and remove an entry named as our temp files beside `target` are, in `directory`."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=directory, prefix=_beside(target, kind)))
    except OSError as e:
        raise _unwritable(path, directory, target, kind, e) from None


def _unwritable(path: Path, directory: Path, target: Path, kind: str, e: OSError) -> HiggsError:
    if e.errno == errno.ENAMETOOLONG:  # the user's name is legal; ours beside it is longer
        longer = len(os.fsencode(_beside(target, kind))) + 8 - len(os.fsencode(target.name))  # mk*temp adds 8
        return HiggsError(f"{path}: name too long: it is written first under a temporary name {longer} bytes longer; "
                          f"use at most {NAME_MAX - longer} bytes")
    return HiggsError(f"{path}: cannot be written in {directory} ({e.strerror or e})")


def output_file(path: Path, inputs=(), probe: bool = True) -> Path:
    """Check that `path` may be written as a file (see the module's rule); returns the path to write. `probe`:
    try creating an entry beside it (callers about to create their temp file there anyway skip it)."""
    target = _resolve(path)
    _check_inputs(path, target, inputs, directory=False)
    _check_model_dirs(path, target)
    # `path`, not `target`: /dev/stdout names a pipe whose resolved name (/proc/PID/fd/pipe:[N]) is no path at all
    if os.path.exists(path) and not os.path.isfile(path):
        raise HiggsError(f"{path}: is {kind_of(os.stat(path).st_mode)}, not a file; refusing to replace it")
    if not target.parent.is_dir():
        what = "is not a directory" if target.parent.exists() else "does not exist"
        raise HiggsError(f"{path}: {target.parent} {what}")
    if probe:
        _probe(path, target.parent, target, "partial")
    return target


def output_dir(path: Path, what: str, foreign: Callable[[Path], str | None], inputs=()) -> Path:
    """Check that `path` may be written as `what` (a directory); returns the path to write.

    `foreign(existing)` says why an existing, non-empty directory is not one this kind of command made (None when
    it is: it may be replaced)."""
    target = _resolve(path)
    _check_inputs(path, target, inputs, directory=True)
    _check_model_dirs(path, target)
    if os.path.lexists(target):
        mode = target.stat().st_mode
        if not stat.S_ISDIR(mode):
            raise HiggsError(f"{path}: is {kind_of(mode)}, not {what}; refusing to replace it")
        if os.path.ismount(target):  # it is replaced by a rename, which a mount point refuses (EBUSY)
            raise HiggsError(f"{path}: is a mount point, which cannot be replaced; give a directory inside it")
        reason = foreign(target) if any(target.iterdir()) else None
        if reason:
            raise HiggsError(f"{path}: {reason}, so it is not {what} this command may replace; "
                             f"move it away or write somewhere else")
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise HiggsError(f"{path}: cannot be created under {parent}")
    _probe(path, parent, target, "staging")
    return target


# Files an engine directory holds besides those its manifest lists: the build's timing cache and plans (listed
# once the build's manifest is written), and the temp files an interrupted build or manifest write leaves, by their
# exact names (builder/trt_build.py, manifest.py): any other file, hidden or not, is the user's.
PLAN_NAMES = r"(lm|codec|codec_encoder)\.plan"
ENGINE_EXTRAS = re.compile(rf"timing\.cache|{PLAN_NAMES}|\.{PLAN_NAMES}\.tmp|\.manifest\.json\.tmp"
                           r"|\.lm(\.[\w-]+)*\.for-tensorrt\.onnx")


def output_engine_dir(path: Path, inputs=()) -> Path:
    """Check that `path` may be written as an engine directory: new, empty, or one higgs-trt made (a manifest.json
    of ours, and no file it does not list)."""
    return output_dir(path, "an engine directory", _not_an_engine_dir, inputs)


def _engine_listing(directory: Path) -> set | None:
    """The files a higgs-trt manifest.json in `directory` lists; None where there is no such manifest."""
    import json

    from .manifest import MANIFEST

    if not (directory / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
        return set(manifest["files"]) if isinstance(manifest, dict) and "format" in manifest else None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def _not_an_engine_dir(directory: Path) -> str | None:
    from .manifest import MANIFEST

    listed = _engine_listing(directory)
    if listed is None:
        return f"holds no higgs-trt {MANIFEST}"
    others = unexpected_entries(directory, lambda n: n in listed or n == MANIFEST or ENGINE_EXTRAS.fullmatch(n))
    return f"holds files an engine directory does not ({_names(others)})" if others else None


def unexpected_entries(directory: Path, allowed: Callable[[str], bool]) -> list[str]:
    """Entries of `directory` that are not regular files with an allowed name (our own leftovers are allowed)."""
    return [p.name for p in directory.iterdir()
            if not (p.is_file() and not p.is_symlink() and (allowed(p.name) or _ours(p.name)))]


def _ours(name: str) -> tuple[str, str, int] | None:
    """(target name, kind, pid) of a name this module made, else None."""
    m = re.fullmatch(rf"\.(.+)\.{TAG}-({'|'.join(KINDS)})\.(\d+)\.[^.]+", name)
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(target: Path) -> list[Path]:
    """Remove work-in-progress of `target` left by processes that are gone; returns what was removed."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for p in target.parent.iterdir():
        mine = _ours(p.name)
        if mine and mine[0] == target.name and not _alive(mine[2]):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


_interrupted = False


def remember_interrupts() -> None:
    """From now on SIGINT raises KeyboardInterrupt as Python's handler does, and is remembered until the next call:
    one raised inside code whose exceptions Python only prints (a weakref callback, a __del__) let an export go on to
    put its output in place and exit 0. Nothing is put in place after a remembered interrupt. SIGTERM likewise, as
    SystemExit(143) instead of dying where it lands, so that temp files and staging directories are removed."""
    global _interrupted
    _interrupted = False

    def handler(signum, frame):
        global _interrupted
        _interrupted = True
        if signum == signal.SIGTERM:
            raise SystemExit(128 + signum)
        signal.default_int_handler(signum, frame)

    if threading.current_thread() is threading.main_thread():
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(sig) is default:
                signal.signal(sig, handler)


def _unless_interrupted() -> None:
    if _interrupted:
        raise KeyboardInterrupt


def _beside(target: Path, kind: str) -> str:
    return f".{target.name}.{TAG}-{kind}.{os.getpid()}."


def partial_file(path: Path, inputs=()) -> tuple[Path, Path]:
    """(target, an empty temp file beside it) for a file written over time; `commit` puts it in place."""
    target = output_file(path, inputs, probe=False)  # the temp file below is the probe
    remove_stale(target)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=_beside(target, "partial"))
    except OSError as e:
        raise _unwritable(path, target.parent, target, "partial", e) from None
    os.close(fd)
    return target, Path(tmp)


def commit(tmp: Path, path: Path, inputs=()) -> None:
    """Rename a finished temp file over its target, the rule checked again (the path may have changed meanwhile)."""
    try:
        target = output_file(path, inputs, probe=False)  # the rename below fails where a probe would
        _unless_interrupted()
        os.chmod(tmp, stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~umask())
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise HiggsError(f"{path}: cannot write ({e.strerror or e})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_file(path: Path, write: Callable[[Path], None], inputs=()) -> None:
    """Call write(tmp) for a temp file beside the target, then rename it over the target: never a partial file."""
    _, tmp = partial_file(path, inputs)
    try:
        write(tmp)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise HiggsError(f"{path}: cannot write ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    commit(tmp, path, inputs)


@contextmanager
def staged_dir(target: Path):
    """A fresh staging directory beside `target` (checked with `output_dir` by the caller); when the block
    finishes it replaces `target` whole; when the block fails it is removed, with any parents made for it."""
    target = Path(target)
    remove_stale(target)
    made = [p for p in reversed(target.parents) if not p.exists()]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=_beside(target, "staging")))
    except OSError as e:
        _remove_empty(made)
        raise HiggsError(f"{target}: cannot be written ({e.strerror or e})") from None
    try:
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp makes it private; the result is an ordinary directory
        yield staging
        _unless_interrupted()
        _publish(staging, target)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(made)
        if isinstance(e, OSError) and e.errno in WRITE_FAILURES:
            raise HiggsError(f"{target}: cannot be written ({e.strerror or e})") from None
        raise


def _remove_empty(made: list[Path]) -> None:
    """Remove the directories a write made for its target, deepest first, while they are empty."""
    for p in reversed(made):
        try:
            p.rmdir()
        except OSError:
            break


def umask() -> int:
    """This process's umask (temp files are made private; what we publish gets the usual permissions)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _publish(staging: Path, target: Path) -> None:
    """Move a finished staging directory into place; a directory already at `target` is replaced whole."""
    old = None
    if os.path.lexists(target):
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=_beside(target, "old")))
        os.replace(target, old / target.name)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
