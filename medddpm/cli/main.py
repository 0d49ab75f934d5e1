"""Command line: `python -m medddpm COMMAND`; `--help` on each (`medddpm.cli.parser`).

Every way a command ends is one line on stderr and an exit status: a fault the user acts on (`errors.UserError`,
any ValueError, an OSError such as a full disk or a file-size limit) is `error: <line>` and status 2; Ctrl-C is
`interrupted: <what was kept>` and 130; SIGTERM, which a cluster's scheduler and `kill` send, is handled as Ctrl-C
is (the same clean-up: locks released, staging folders removed, files whole) and ends in `terminated: <what was
kept>` and 143 (128 + the signal's number, what a shell reports for it), so that the same command resumes. A
`errors.Notice` is printed as `warning: <line>`."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import warnings
from typing import Iterator

from medddpm.errors import Notice, UserError
from medddpm.store.storage import Interrupted, describe_os_error
from medddpm.cli.commands import interrupted
from medddpm.cli.parser import build_parser

SIGINT_EXIT = 128 + signal.SIGINT  # 130, what a shell reports for a command Ctrl-C stopped
STOP_SIGNALS = (signal.SIGTERM,)  # handled as Ctrl-C is; exit status 128 + its number


class Terminated(KeyboardInterrupt):
    """A stop signal (SIGTERM) arrived; raised where it interrupted the main thread, so that every clean-up a
    Ctrl-C runs runs too."""


@contextlib.contextmanager
def stop_signals_as_interrupts() -> Iterator[list[int]]:
    """Within the block, a STOP_SIGNALS signal raises `Terminated` in the main thread; yields the list of the
    signals received. A second one while the first's clean-up runs is ignored, so that the clean-up ends (a
    scheduler that will not wait sends SIGKILL). Outside the main thread (no handler can be set) nothing changes."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def stop(signum, frame):
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        received.append(signum)
        raise Terminated(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _show_notice(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning):
    if issubclass(category, Notice):
        print(f"warning: {message}", file=sys.stderr)
    else:
        _default(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    received: list[int] = []
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_notice
            with stop_signals_as_interrupts() as received:
                args.func(args)
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: what was kept and how to go on, not a traceback
        said = e if isinstance(e, Interrupted) else interrupted(args)
        if received:
            print(f"terminated ({signal.Signals(received[0]).name}): {said}", file=sys.stderr)
            return 128 + received[0]
        print(f"interrupted: {said}", file=sys.stderr)
        return SIGINT_EXIT
    except BrokenPipeError:  # the reader stopped (`| head`): the rest of the output is not wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a file system's refusal that no layer named: its path and reason, in one line
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    finally:
        release()
    return 0


def release() -> None:
    """Stop what a command's work leaves running, so that the process ends with its work: Inductor's pool of
    compile workers (subprocesses that a compiled configuration starts and the interpreter would wait for at
    exit) and a profiler left attached by an error inside its context."""
    if "torch._inductor.async_compile" in sys.modules:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    if "torch" in sys.modules:
        import torch

        if torch.autograd.profiler._is_profiler_enabled:
            torch.autograd._disable_profiler()


if __name__ == "__main__":
    sys.exit(main())
