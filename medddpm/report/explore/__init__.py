"""JupyterLab explorers (ipywidgets): a slice viewer for volumes and their label maps (`volumes`), and an
explorer over the measurements under ``data/`` (`measurements`).

`SliceViewer` shows one slice of a volume with its label map drawn over it, for training pairs and generated
samples. `DataExplorer` puts dropdowns for GPU, configuration, kernel category and view over the tables
`medddpm.report` reads, and draws the chosen view as an Altair chart. ipywidgets need a kernel; in a static
page use `SliceViewer.png` and `DataExplorer.chart` for a still (`stills`: the explorers page's).
"""

from medddpm.report.explore.measurements import ALL, VIEWS, DataExplorer  # noqa: F401
from medddpm.report.explore.volumes import (AXES, LABEL_COLORS, SliceViewer, labels_from_condition,  # noqa: F401
                                            png_bytes)
from medddpm.report.explore.stills import (LABELS, check_explorer, middle_views, show_stalls,  # noqa: F401
                                           training_pairs, views_caption)
