"""Files are written whole or not at all: write to a temporary file beside the target, then rename.
Folders are published the same way: a staged folder takes the place of the old one in one atomic step.

A write that the file system refuses (a full disk, a file-size limit, a read-only or forbidden folder) raises
`StorageError`, a ValueError whose message is one line naming the path and the reason, e.g. "the disk is full".

A file the product reads from a path a user gives (a checkpoint, a log, a table) is opened by `open_regular`: a
regular file, or a one-line `NotRegularFile` naming what the path is instead. A named pipe would block its reader
for ever, a folder or a device reads as nonsense; none of them is opened in a way that can block."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from medddpm.errors import UserError
from medddpm.store.layout import is_run

_REASONS = {
    errno.ENOSPC: "the disk is full (no space left on device)",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EEXIST: "a part of the path is a file, not a folder",
    errno.EISDIR: "a folder, not a file",
    errno.EFBIG: "the file exceeds the largest file allowed (the shell's file-size limit, ulimit -f, or the file "
                 "system's)",
    errno.ELOOP: "a symlink loop",
}


def os_error_reason(e: OSError) -> str | None:
    """What the file system said, in words a user acts on ("the disk is full"), or None for another fault."""
    return _REASONS.get(e.errno)


class StorageError(UserError):
    """The file system refused a write (one line: the path and why)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a command's work; str(e) is one line saying what was kept and how to resume (the command
    line prints it and exits 130, as a shell does for SIGINT)."""


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: the path it names, if any, and the reason in words a user acts on."""
    reason = os_error_reason(e) or e.strerror or str(e) or type(e).__name__
    return f"{e.filename}: {reason}" if e.filename and e.strerror else reason


def storage_error(path: str | os.PathLike, e: OSError) -> StorageError:
    """`e`, raised while writing `path`, as a one-line StorageError: the file system's reason in words where it is
    one a user acts on ("the disk is full"), else its own."""
    return StorageError(f"cannot write {path}: {os_error_reason(e) or e.strerror or e}")


class NotRegularFile(UserError):
    """A path the product reads is not a regular file (a folder, a named pipe, a device, a socket): one line naming
    it and what it is."""


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(path: str | os.PathLike, mode: int, what: str) -> NotRegularFile | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    return NotRegularFile(f"{path}: {kind}, not a regular file; {what} is read from a regular file only")


def check_regular(path: str | os.PathLike, what: str = "it") -> None:
    """Refuse, in one line, a path that exists but is not a regular file (`stat` follows symlinks and never
    blocks); a missing path raises FileNotFoundError, a symlink loop a NotRegularFile."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(f"{path}: a symlink loop, not a regular file") from None
        raise
    if (error := _not_regular(path, mode, what)) is not None:
        raise error


def open_regular(path: str | os.PathLike, what: str = "it") -> BinaryIO:
    """`path` opened for reading in binary mode, refused in one line unless it is a regular file. It is checked
    before it is opened, and opened without blocking (O_NONBLOCK: an open of a named pipe waits for a writer) and
    checked again through the descriptor, so that a path swapped meanwhile is refused too."""
    check_regular(path, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if (error := _not_regular(path, os.fstat(fd).st_mode, what)) is not None:
            raise error
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, what: str = "it") -> bytes:
    """The bytes of a regular file (`open_regular`)."""
    with open_regular(path, what) as f:
        return f.read()


def _umask() -> int:
    """The process's umask: read from /proc where the kernel shows it, since setting it to read it back
    would leave other threads a moment with another umask."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Call `write(f)` on a temporary file in the target's folder, then rename it into place
    (os.replace is atomic on POSIX), so a killed process never leaves a half-written file.
    The file gets the mode an ordinary `open` would give it (0666 less the umask), not mkstemp's 0600,
    so that others on a shared file system read results as the user's umask allows."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise storage_error(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, StorageError):
            raise storage_error(path, e) from None
        raise
    return path


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the system or the
    file system has no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise storage_error(b, OSError(err, os.strerror(err), str(b)))


def publish_folder(stage: str | os.PathLike, final: str | os.PathLike, old: str | os.PathLike) -> None:
    """Put the complete folder `stage` at `final` in one atomic step; `final`'s previous content, if any, ends
    up at `stage` or at `old` (hidden names beside it), which the caller removes.

    Where `final` exists the two folders are exchanged (renameat2): at every instant `final` holds either
    the old result or the new one, and after a crash the other is at `stage`. Without
    that call (another system, a file system without it) the old folder is renamed to `old` first and the
    stage into place second; a crash between the two leaves `final` missing and the previous result at
    `old`, which `recover_folder` puts back."""
    stage, final, old = Path(stage), Path(final), Path(old)
    try:
        if not final.exists():
            try:
                os.rename(stage, final)
                return
            except OSError as e:  # another publisher put it there first: exchange with theirs
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        if _exchange(stage, final):
            return
        os.rename(final, old)
        os.rename(stage, final)
    except OSError as e:
        raise storage_error(final, e) from None


def recover_folder(final: str | os.PathLike, leftovers: list[Path]) -> None:
    """After a crash while publishing `final`: where `final` is missing, the newest leftover that holds a
    finished run (`layout.is_run`) is the previous result and goes back in place."""
    final = Path(final)
    if final.exists():
        return
    done = [p for p in leftovers if is_run(p)]
    if done:
        os.rename(max(done, key=lambda p: p.stat().st_mtime), final)
