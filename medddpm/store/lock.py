"""One writer per output folder: a second sweep or training into a folder in use fails at once.

    from medddpm.store.lock import output_lock, FolderInUse

    with output_lock(folder, what="sweep"):
        ...  # only this process writes under `folder` until the block ends

The lock is an advisory `flock` on `.<folder>.lock` beside the folder (`lock_path`), so that taking it creates
nothing in a folder a bad input then leaves unwritten, and the kernel releases it when its holder
ends in any way (killed, out of memory, power lost on a local disk): a lock left by a dead process never
blocks. The file holds the holder's pid, host, start time and what it does, for the one-line message a
second writer gets (`FolderInUse`, a ValueError: the command line prints it as `error: ...`, exit code 2).
The holder removes the file as it releases the lock; a writer that locked a file removed meanwhile (its
path now names another file, or none) drops it and tries again, so two writers never hold two files of one
name. `lock_file` puts the file elsewhere: one lock for several folders (a run and its variants).

Within one process the lock is re-entrant: a sweep that holds its folder may call code that locks it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from medddpm.errors import UserError
from medddpm.store.storage import NotRegularFile, os_error_reason, read_regular



def lock_path(folder: str | os.PathLike) -> Path:
    """`.<name>.lock` beside `folder`: where its lock lives unless told otherwise."""
    folder = Path(folder).absolute()
    return folder.parent / f".{folder.name}.lock"


_held: dict[Path, int] = {}  # folders this process holds, with their nesting depth
_guard = threading.Lock()
_fds: set[int] = set()  # the descriptors of the locks this process holds


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the lock descriptors, without unlocking: a flock
    lasts while any copy is open, so a child that outlives its killed parent by seconds would hold the folder."""
    for fd in list(_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _fds.clear()


os.register_at_fork(after_in_child=_close_in_child)


class FolderInUse(UserError):
    """Another process holds the folder's lock; the message is one line naming it (pid, host, since when)."""

    def __init__(self, folder: Path, what: str, holder: dict):
        self.folder, self.what, self.holder = folder, what, holder
        if holder:
            who = (f"{holder.get('what') or 'another process'} (pid {holder.get('pid', '?')} on host "
                   f"{holder.get('host', '?')}, since {holder.get('since', '?')})")
        else:
            who = "another process (it has not yet said which)"
        super().__init__(f"{folder} is in use by {who}; this {what} does not write into it "
                         f"(wait for that one to end, or choose another folder)")


def lock_holder(folder: str | os.PathLike, lock_file: str | os.PathLike | None = None) -> dict:
    """What the lock file of `folder` says of its holder: pid, host, since, what ({} if none). Whether the
    lock is held is known only by trying to take it (`output_lock`)."""
    try:
        text = read_regular(Path(lock_file or lock_path(folder))).decode(errors="replace")
    except (OSError, NotRegularFile):  # gone, or not a file (a named pipe would block the read)
        return {}
    info = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("pid", "host", "since", "what"):
            info[key] = value.strip()
    return info


def _open(folder: Path, lock_file: Path) -> int:
    """The lock file's descriptor, with one-line errors for a folder that cannot hold it."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder")
    try:
        if lock_file.parent == folder:  # a lock beside the folder leaves creating it to the writer
            folder.mkdir(parents=True, exist_ok=True)
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        return os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # a parent that is a file, no permission, a full disk, a read-only file system
        if (reason := os_error_reason(e)) is None:
            raise
        raise ValueError(f"{folder}: {reason}") from None


@contextmanager
def output_lock(folder: str | os.PathLike, what: str = "sweep", *,
                lock_file: str | os.PathLike | None = None) -> Iterator[Path]:
    """Hold `folder`'s lock for the block (creating the folder, for a lock inside it); raise `FolderInUse` at
    once if another process holds it. `what` names this writer in the message another one gets ("sweep",
    "training"); `lock_file`: where the lock lives (default `lock_path(folder)`, beside it)."""
    folder = Path(folder)
    lock_file = Path(lock_file) if lock_file is not None else lock_path(folder)
    key = lock_file.resolve()
    with _guard:
        if key in _held:
            _held[key] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield folder
        finally:
            with _guard:
                _held[key] -= 1
        return

    while True:
        fd = _open(folder, lock_file)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = lock_holder(folder, lock_file)
            if not holder:  # taken an instant ago: its holder is writing its name
                time.sleep(0.05)
                holder = lock_holder(folder, lock_file)
            raise FolderInUse(folder, what, holder) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock_file))
        except FileNotFoundError:
            same = False
        if same:
            _fds.add(fd)
            break
        os.close(fd)  # its holder removed it as we opened it: lock the file the path names now
    try:
        # Written in place, not through atomic_write: the lock is on this file's inode, so the file is
        # never replaced; its text only informs a second writer.
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        text = f"pid={os.getpid()}\nhost={socket.gethostname()}\nsince={since}\nwhat={what}\n".encode()
        try:
            os.ftruncate(fd, 0)  # a killed holder's text may still be there
            os.pwrite(fd, text, 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, a second writer's message just names no holder
        with _guard:
            _held[key] = 1
        try:
            yield folder
        finally:
            with _guard:
                _held.pop(key, None)
            with contextlib.suppress(OSError):
                os.unlink(lock_file)  # while still locked: see the module's docstring
    finally:
        _fds.discard(fd)
        os.close(fd)  # releases the flock
