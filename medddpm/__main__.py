"""`python -m medddpm`: the command line (`medddpm.cli.main`)."""

import os
import sys
import threading

from medddpm.cli.main import main

EXIT_WAIT_S = 10.0  # how long the interpreter's own shutdown may wait for threads still running


def exit_after(code: int) -> None:
    """Exit with `code` as Python does (atexit handlers, idle thread pools joined), but at most EXIT_WAIT_S
    seconds after the work is done: a library thread that never ends (a compile or profiler worker the
    command's own shutdown did not reach) no longer keeps a finished command alive."""
    def force():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(EXIT_WAIT_S, force)
    timer.daemon = True
    timer.start()
    sys.exit(code)


if __name__ == "__main__":
    exit_after(main())
