"""Command line: `python -m medddpm COMMAND`; `--help` on each (`medddpm.cli.parser`)."""

from __future__ import annotations

import sys

from medddpm.configs import ConfigError
from medddpm.store.storage import Interrupted
from medddpm.train.data import DataError
from medddpm.cli.commands import interrupted
from medddpm.cli.parser import build_parser

SIGINT_EXIT = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C stopped


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: what was kept and how to go on, not a traceback
        print(f"interrupted: {e if isinstance(e, Interrupted) else interrupted(args)}", file=sys.stderr)
        return SIGINT_EXIT
    except BrokenPipeError:  # the reader stopped (`| head`): the rest of the output is not wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
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
