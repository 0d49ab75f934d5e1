"""What the book's pages read: every run under ``data/``, validated, and the summaries each page draws.

A facade over one module per page (as HTA's `TraceAnalysis` is over its analyses): `loading` reads the data
tree; `step_time`, `beyond`, `kernels`, `counters`, `quality`, `memory` and `scaling` summarise it for their
pages; `claims` judges the paper's claims on it; `charts` draws the figures, `workshop` and `explore` serve
the hands-on pages. Pages call ``report.<summary>(...)`` and the ``check_*`` functions, which assert that
their numbers are sane. The figure and widget modules (Altair, ipywidgets) load only when imported.
"""

from ..configs import CONFIGS, PAPER  # noqa: F401 - for the pages
from .beyond import *  # noqa: F401,F403
from .counters import *  # noqa: F401,F403
from .kernels import *  # noqa: F401,F403
from .loading import *  # noqa: F401,F403
from .loading import _sort  # noqa: F401 - the workshop's tables sort as the pages' do
from .memory import *  # noqa: F401,F403
from .quality import *  # noqa: F401,F403
from .scaling import *  # noqa: F401,F403
from .step_time import *  # noqa: F401,F403
