"""File writing and hashing shared by checkpoints, traces, training state, reports and the study.

Only the standard library: a module that writes a file does not pay for torch to do it.

- :func:`atomic_write`: one file, replaced by a rename (readers see the old or the new file).
- :func:`exclusive_lock`: one writer per destination; a second one is refused at once.
- :func:`write_directory`: the one folder writer (traces, corpus stats, checkpoints): locked,
  written beside its destination, fsynced and swapped in (with :func:`clear_leftovers` for what a
  killed save left).
- :func:`replace_directory`: a folder replaced by one rename (``renameat2(RENAME_EXCHANGE)``
  where the kernel has it, otherwise two renames that the next save undoes if interrupted).
- :func:`read_json`: a JSON file read with a size cap, never a traceback for a hostile file.
- :func:`fault_point`: named points where the fault tests kill the process or fail a write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FAULT_ENV",
    "DestinationBusyError",
    "atomic_write",
    "clear_leftovers",
    "exclusive_lock",
    "fault_point",
    "lock_path",
    "read_json",
    "remove_stale_temps",
    "replace_directory",
    "restore_directory",
    "set_aside",
    "sha256_file",
    "staging_dirs",
    "write_directory",
    "write_error",
]

FAULT_ENV = "ATTNRES_PROBE_FAULT"
TMP_SUFFIX = ".tmp"


class DestinationBusyError(FileExistsError):
    """Another writer (process or thread) holds the lock on the destination."""


# -- single files ----------------------------------------------------------------------------
def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it onto ``path``.

    The rename is atomic, so readers see the old file or the new one, never half of one; if
    ``write`` fails (or is interrupted), ``path`` is untouched and the temporary file removed.
    The temporary file's name carries the writer's process id, so a temporary file left by a
    killed writer is recognised and removed by the next write of the same path.

    Args:
        path: the file to create or replace; its folder must exist.
        write: writes the whole content to the path it is given.
    """
    path = Path(path)
    refuse_special(path)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=TMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        fault_point(f"atomic_write:{path.name}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def special_kind(path: str | Path) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a symlink (which a rename
    replaces without touching its target): "folder", "character device", "block device", "FIFO",
    "socket"; None otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return None


def refuse_special(path: str | Path) -> None:
    """Refuse to replace anything at ``path`` but a regular file (or a symlink, itself): never a device,
    FIFO, socket or folder, even when the caller was told to overwrite (``--force``)."""
    kind = special_kind(path)
    if kind is not None:
        raise FileExistsError(errno.EEXIST, f"{path} is a {kind}, not a regular file; it is never replaced "
                                            "(choose a file path)", str(path))


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Remove the temporary files of :func:`atomic_write` for ``path`` whose writer has died.

    Returns:
        the files removed.
    """
    path = Path(path)
    prefix = f".{path.name}."
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(TMP_SUFFIX)):
            continue
        pid = name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_error(exc: OSError, what: str, path: str | Path, kept: str) -> OSError:
    """A one-line OSError for a failed save: ``cannot save {what} to {path}: {cause}; {kept}``.

    Args:
        exc: the error the write raised (its errno is kept).
        what: what was being saved ("the trace", "the training checkpoint").
        path: the destination.
        kept: what is still there ("nothing was written", "the previous trace is unchanged").
    """
    cause = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        cause = "no space left on the device"
    elif exc.errno == errno.EROFS:
        cause = "the file system is read-only"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        cause = "permission denied"
    err = OSError(f"cannot save {what} to {path}: {cause}; {kept}")
    err.errno = exc.errno
    return err


# -- locks -----------------------------------------------------------------------------------
def lock_path(target: str | Path) -> Path:
    """The lock file of a destination: ``.{name}.lock`` beside it (it exists only while held)."""
    target = Path(os.path.abspath(target))
    return target.parent / f".{target.name}.lock"


@contextlib.contextmanager
def exclusive_lock(target: str | Path, flag: str = "--out") -> Iterator[Path]:
    """Hold an exclusive ``flock`` on ``target`` for the block; refuse at once if another holds it.

    The lock lives in ``.{name}.lock`` beside ``target`` (so a folder that is swapped for a new
    one stays locked), created on entry and removed on exit. A lock left by a killed process
    is free again (the kernel drops it), so it never needs clearing by hand.

    Args:
        target: the file or folder about to be written (its parent folder is created).
        flag: how the command line names the destination, for the message.

    Raises:
        DestinationBusyError: another process or thread is writing ``target``.
        OSError: the lock file cannot be created (read-only or missing parent folder).
    """
    path = lock_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise DestinationBusyError(
                f"{Path(target)} is being written by another process ({holder}it holds {path}); wait for it to "
                f"finish or choose another {flag}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the holder before us may have removed the file after we opened it: lock the live one
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    with contextlib.suppress(OSError):  # say who holds it, for a writer that is refused
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _lock_holder(fd: int, wait: float = 0.2) -> str:
    """``"PID 123; "`` from a held lock file, or ``""``. The holder writes its process id just
    after taking the lock: a writer refused in that instant waits up to ``wait`` seconds for it."""
    deadline = time.monotonic() + wait
    while True:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            return ""
        if text.isdigit():
            return f"PID {text}; "
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.005)


# -- folders ---------------------------------------------------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2``); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # an old kernel or a file system without exchange: use the fallback
    raise OSError(code, os.strerror(code), str(b))


def replace_directory(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target`` (which may exist) so that ``target`` is never half-written.

    With ``renameat2(RENAME_EXCHANGE)`` the two folders swap in one step and the old one (now
    at ``new``) is removed. Without it, ``target`` is first renamed aside to
    ``.{name}.old-{pid}`` and ``new`` renamed onto ``target``; :func:`restore_directory` puts
    the old folder back if a kill came between the two renames.
    """
    fault_point("replace_directory:before")
    if not target.exists():
        os.rename(new, target)
        return
    if _exchange(new, target):
        fault_point("replace_directory:swapped")
        shutil.rmtree(new, ignore_errors=True)
        return
    aside = target.parent / f".{target.name}.old-{os.getpid()}"
    os.rename(target, aside)
    fault_point("replace_directory:aside")
    os.rename(new, target)
    shutil.rmtree(aside, ignore_errors=True)


def set_aside(target: Path) -> list[Path]:
    """Folders that :func:`replace_directory`'s fallback set aside beside ``target``."""
    return sorted(target.parent.glob(f".{glob_escape(target.name)}.old-*"))


def restore_directory(target: Path, is_complete: Callable[[Path], bool]) -> Path | None:
    """Put back a folder set aside by an interrupted :func:`replace_directory`; call it under the lock.

    Returns:
        the folder restored to ``target``, or None.
    """
    if target.exists():
        return None
    for aside in reversed(set_aside(target)):
        if is_complete(aside):
            os.rename(aside, target)
            return target
    return None


def staging_dirs(target: Path) -> list[Path]:
    """Hidden folders beside ``target`` that saves use while writing: ``.{name}.new-*`` and
    ``.{name}.old-*``, and the names corpus stats used before they shared this writer
    (``.{name}.saving-*``, ``.{name}.old``)."""
    name = glob_escape(target.name)
    patterns = (".{}.new-*", ".{}.old-*", ".{}.saving-*", ".{}.old")
    found = [p for pattern in patterns for p in target.parent.glob(pattern.format(name))]
    return sorted(p for p in found if p.is_dir() and not p.is_symlink())


def clear_leftovers(target: Path, is_complete: Callable[[Path], bool], files: Sequence[str] = ()) -> None:
    """Undo what a killed save left beside ``target``; call it with ``target``'s lock held.

    A folder set aside by an interrupted :func:`replace_directory` (or by the fixed-name swap
    corpus stats used before) is put back if ``is_complete`` says it is whole; then the hidden
    staging folders of unfinished saves are removed, beside ``target`` and inside it (those of
    :func:`write_directory`'s in-place writes), with the temporary files of dead writers of
    ``files`` inside it.
    """
    restore_directory(target, is_complete)
    legacy = target.parent / f".{target.name}.old"
    if not target.exists() and legacy.is_dir() and not legacy.is_symlink() and is_complete(legacy):
        os.rename(legacy, target)
    for leftover in staging_dirs(target):
        shutil.rmtree(leftover, ignore_errors=True)
    if target.is_dir():
        for leftover in target.glob(f".{glob_escape(target.name)}.new-*"):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
        for name in files:
            remove_stale_temps(target / name)


def write_directory(
    target: str | Path,
    write: Callable[[Path], object],
    is_complete: Callable[[Path], bool],
    files: Sequence[str],
    *,
    check: Callable[[Path], object] | None = None,
    keep_others: bool = False,
    flag: str = "--out",
) -> Path:
    """Write folder ``target`` crash-safely: the one folder writer of traces, corpus stats and checkpoints.

    It holds ``target``'s lock throughout (:func:`exclusive_lock`: a second writer is refused at
    once), clears what killed saves left (:func:`clear_leftovers`), and runs ``check(target)``,
    the caller's refusals, now that no one else writes there. Then ``write(staging)`` fills a
    hidden folder ``.{name}.new-PID-…`` beside ``target``; its files and the folder are fsynced,
    and it replaces ``target`` by one rename (:func:`replace_directory`, then the parent folder
    is fsynced). At every moment ``target`` holds the old folder or the new one, complete; a
    failed or killed write leaves the old one, and its staging folder is removed now or by the
    next save. ``target`` is replaced as a whole, hidden files included.

    Written in place instead, keeping what else the folder holds: a ``target`` that is the
    working directory or holds it, or a mount point (neither can be renamed), and with
    ``keep_others`` a ``target`` that holds any entry not in ``files``. Then ``write`` fills a
    hidden folder inside ``target``, fsynced, whose files are renamed onto their names one by
    one in the order of ``files`` (the file that marks the folder complete last). A failure
    before the renames leaves ``target`` as it was; the files a failed write added are removed.

    Args:
        target: the folder (created with its parents; a symlink is followed and the folder it
            names is written).
        write: writes every file of ``files`` into the empty folder it is given.
        is_complete: whether a folder set aside by an interrupted swap holds a whole save (it is
            put back).
        files: the names ``write`` produces, the one that marks the folder complete last.
        check: called with ``target`` (resolved) under the lock, before anything is written;
            it raises to refuse.
        keep_others: a folder holding other entries is written into, not replaced.
        flag: how the command line names the destination, for the lock's message.

    Returns:
        ``target``, resolved.

    Raises:
        DestinationBusyError: another writer holds ``target``.
        NotADirectoryError: ``target`` is a file.
        OSError: the write failed.
    """
    target = Path(os.path.realpath(target))
    with exclusive_lock(target, flag):
        clear_leftovers(target, is_complete, files)
        if check is not None:
            check(target)
        if target.exists() and not target.is_dir():
            raise NotADirectoryError(f"{target} is a file; it is saved as a folder: give a folder path")
        if target.is_dir() and (_holds_cwd(target) or (keep_others and any(n not in files for n in os.listdir(target)))):
            _write_in_place(target, write, files)  # the working directory cannot be renamed away; others are kept
            return target
        staging = target.parent / f".{target.name}.new-{os.getpid()}-{os.urandom(4).hex()}"
        staging.mkdir(0o777)  # the usual permissions (the umask applies) ...
        try:
            if target.is_dir():
                os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))  # ... or the replaced folder's
            write(staging)
            _fsync_folder(staging)
            fault_point("write_directory:written")
            try:
                replace_directory(staging, target)
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.EXDEV) or not target.is_dir():
                    raise
                _write_in_place(target, write, files)  # a mount point cannot be renamed: write into it
            else:
                _fsync_folder(target.parent, files=False)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_in_place(target: Path, write: Callable[[Path], object], files: Sequence[str]) -> None:
    """:func:`write_directory` into ``target`` itself: a hidden staging folder inside it (on the same
    file system), then one rename per file, in the order of ``files``."""
    staging = target / f".{target.name}.new-{os.getpid()}-{os.urandom(4).hex()}"
    staging.mkdir(0o700)
    added: list[Path] = []
    try:
        write(staging)
        _fsync_folder(staging)
        fault_point("write_directory:written")
        for name in files:
            dest = target / name
            existed = os.path.lexists(dest)
            os.replace(staging / name, dest)
            if not existed:
                added.append(dest)
        _fsync_folder(target, files=False)
    except BaseException:
        for path in added:
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fsync_folder(folder: Path, files: bool = True) -> None:
    """fsync the regular files directly in ``folder`` (with ``files``), then the folder itself, so
    that what a rename publishes is on disk when a crash of the machine follows it. A file system
    that cannot fsync a folder is skipped."""
    if files:
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _holds_cwd(folder: Path) -> bool:
    """Whether ``folder`` is the working directory or one of its parents."""
    try:
        cwd = Path(os.getcwd())
    except OSError:
        return False
    return cwd == folder or folder in cwd.parents


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters escaped."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


# -- reading ---------------------------------------------------------------------------------
def read_json(path: str | Path, error: type[Exception] = ValueError, max_bytes: int = 64 * 2**20) -> Any:
    """Parse a JSON file, turning every way it can be hostile into ``error`` with one line.

    Args:
        path: the file.
        error: the exception class to raise (e.g. TraceError, CheckpointError).
        max_bytes: larger files are refused before reading.

    Raises:
        error: missing, not a regular file, too large, not UTF-8, not JSON, nested too deep.
    """
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        raise error(f"{path} cannot be read ({exc.strerror or exc})") from None
    if not path.is_file():
        raise error(f"{path} is not a regular file")
    if st.st_size > max_bytes:
        raise error(f"{path} is {st.st_size} bytes; at most {max_bytes} are read for a JSON file of this kind")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise error(f"{path} is nested too deeply to be a file of this kind") from None
    except OSError as exc:
        raise error(f"{path} cannot be read ({exc.strerror or exc})") from None


# -- fault injection (tests and benchmarks/faults.py) ----------------------------------------
_FAULT_COUNTS: dict[str, int] = {}
_FAULT_SPEC: list[str] = [""]  # the spec the counts belong to
_FAULT_ERRNOS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS, "eio": errno.EIO}


def fault_point(name: str) -> None:
    """Kill the process or fail a write here, when ``ATTNRES_PROBE_FAULT`` names this point.

    ``ATTNRES_PROBE_FAULT`` holds comma-separated ``ACTION@POINT[#N]`` items: ``kill`` (SIGKILL
    this process), ``enospc``, ``erofs`` or ``eio`` (raise that OSError), every time the point
    is reached, or with ``#N`` only the N-th time (counted since the variable last changed).
    Unset, this costs one dictionary lookup.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    if spec != _FAULT_SPEC[0]:
        _FAULT_SPEC[0] = spec
        _FAULT_COUNTS.clear()
    count = _FAULT_COUNTS[name] = _FAULT_COUNTS.get(name, 0) + 1
    for item in spec.split(","):
        action, _, point = item.strip().partition("@")
        point, _, nth = point.partition("#")
        if point != name or (nth.isdigit() and count != int(nth)):
            continue
        if action == "kill":
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if action in _FAULT_ERRNOS:
            code = _FAULT_ERRNOS[action]
            raise OSError(code, os.strerror(code), name)


# -- progress ----------------------------------------------------------------------------------
PROGRESS_ENV = "ATTNRES_PROGRESS"  # "1": say each slow step even when stderr is not a terminal; "0": never


def say(message: str) -> None:
    """One line on stderr for a step that takes seconds ("recording the text ..."), where a person
    watches: stderr a terminal, or ``$ATTNRES_PROGRESS=1``. Pipes and logs get only results and errors."""
    flag = os.environ.get(PROGRESS_ENV)
    if flag == "0" or not (flag == "1" or sys.stderr.isatty()):
        return
    print(message, file=sys.stderr, flush=True)


# -- the digest of a model ---------------------------------------------------------------------
def weights_sha256(model: Any) -> str:
    """The one digest of a model, which traces, reports and corpus runs record as ``weights_sha256``:
    hex sha256 over its state dict (name, shape and fp32 bytes of every tensor, in name order). Takes
    any ``torch.nn.Module`` without importing torch here."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu()
        t = t.float() if t.is_floating_point() else t
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()
