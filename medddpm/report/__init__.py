"""What the book's pages read: every run under ``data/``, validated, and the summaries each page draws.

A facade over one module per page (as HTA's `TraceAnalysis` is over its analyses): `loading` reads the data tree
and `roofs` gives each card's roofs (measured, else its datasheet's); `step_time`, `beyond`, `kernels`,
`counters`, `quality`, `memory` and `scaling` summarise it for their pages (`cards`, the cross-card page's, is
read as a module: `report.cards`); `claims` judges the paper's claims on it; `charts` draws the figures,
`workshop` and `explore` serve the hands-on pages. Pages call ``report.<summary>(...)`` and the ``check_*``
functions, which assert that their numbers are sane. The figure and widget modules (Altair, ipywidgets) load
only when imported.
"""

from medddpm.configs import CONFIGS, PAPER  # noqa: F401 - for the pages
from medddpm.report.beyond import *  # noqa: F401,F403
from medddpm.report.counters import *  # noqa: F401,F403
from medddpm.report.kernels import *  # noqa: F401,F403
from medddpm.report.loading import *  # noqa: F401,F403
from medddpm.report.loading import _sort  # noqa: F401 - the workshop's tables sort as the pages' do
from medddpm.report.memory import *  # noqa: F401,F403
from medddpm.report.quality import *  # noqa: F401,F403
from medddpm.report.roofs import *  # noqa: F401,F403
from medddpm.report.scaling import *  # noqa: F401,F403
from medddpm.report.step_time import *  # noqa: F401,F403
