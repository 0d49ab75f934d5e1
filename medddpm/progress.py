"""Progress bars: tqdm's, shown unless the caller turns them off or the environment's TQDM_DISABLE does.

tqdm takes its TQDM_* variables as defaults only (`tqdm.utils.envwrap`): a bar given ``disable=False`` shows even where
TQDM_DISABLE=1 asks for none, as the sweep asks for the producer notebook, whose stored outputs would keep every
redraw. So a bar that may show is given no `disable` at all."""

from __future__ import annotations

from tqdm import tqdm  # text bars: tqdm.auto draws ipywidgets bars, a message per update under papermill


def progress_bar(iterable=None, *, progress: bool = True, **kw) -> tqdm:
    """tqdm(iterable, **kw), off where `progress` is False."""
    if not progress:
        kw["disable"] = True
    return tqdm(iterable, **kw)
