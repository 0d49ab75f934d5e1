"""IPython kernel configuration of this project's environment: `scripts/setup.sh` copies it to
`.venv/etc/ipython/`, where every kernel started from `.venv` reads it (the book's pages, the sweep's producer
notebooks, JupyterLab).

Such a kernel talks to its client over local TCP sockets whose every message is signed with a key that only
this user can read, and ipykernel warns at each start that the transport is not encrypted: a line per page
and per notebook that asks nothing of the reader, so that one message is left out (every other stays)."""

import logging


class _LocalTransportNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "running over TCP without encryption" not in record.getMessage()


logging.getLogger("IPKernelApp").addFilter(_LocalTransportNotice())
