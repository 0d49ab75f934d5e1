"""What the book's pages read: every run under ``data/``, validated, and the summaries each page draws.

A facade over one module per page (as HTA's `TraceAnalysis` is over its analyses): `loading` reads the data tree
and `roofs` gives each card's roofs (measured, else its datasheet's); `intro`, `methodology`, `step_time`,
`cards` (with `card_compare`), `kernels`, `counters`, `beyond`, `memory`, `scaling`, `quality`, `convergence`,
`claims`, `reproduce` and `appendix` summarise it for their pages; `charts` draws the figures, `tables` sets the
tables, `workshop` and `explore` serve the hands-on pages. A page imports this package under its own name (``from
medddpm import report``) and calls ``report.<summary>(...)``, ``report.<page>.<summary>(...)`` and the ``check_*``
functions, which assert that its numbers are sane; it imports nothing past this package. The page modules that
need Altair, ipywidgets or torch load on first use (``report.charts``, ``report.workshop``, ...), so a page pays
only for what it draws.
"""

import importlib

from medddpm.configs import CONFIGS, PAPER  # noqa: F401 - for the pages
from medddpm.store.layout import WORK  # noqa: F401 - runs/: where a page finds what the user's commands wrote
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

# The submodules a page reaches as ``report.<name>``: imported on first use (PEP 562), so that a page that draws
# no chart never loads Altair and one that trains nothing never loads the workshop's torch code.
SUBMODULES = ("appendix", "beyond", "card_compare", "cards", "charts", "claim_evidence", "claim_rules", "claims",
              "convergence", "counters", "end_to_end", "equivalence", "explore", "intro", "kernels", "loading", "memory",
              "methodology", "quality", "reproduce", "roofs", "scaling", "step_time", "tables", "workshop")


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
