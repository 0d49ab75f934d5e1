"""The one family of errors a user acts on: bad input, a file the product will not read, a file system that
refuses a write, a data tree that does not read, a request that cannot fit. Each is a `UserError` (a ValueError)
whose text is one line naming what and why; the command line catches the family in one place
(`medddpm.cli.main`), prints `error: <line>` and exits with status 2, where any other exception would print a
traceback. Every module's own error class (`configs.ConfigError`, `train.nifti.DataError`,
`report.loading.DataError`, `store.storage.StorageError`, ...) derives from it.

A `Notice` is the family's warning: one line the command line prints as `warning: <line>` and goes on.

This module imports nothing of the package, so that every layer, the measuring side and the report side alike,
can raise its errors."""

from __future__ import annotations


class UserError(ValueError):
    """A fault the user acts on; str(e) is one line (a message of several lines is joined into one)."""

    def __init__(self, message: object = ""):
        super().__init__(" ".join(str(message).splitlines()))


class Notice(UserWarning):
    """Something the user should know that stops nothing (one line): the command line prints `warning: <line>`."""
