"""The panel's figures live with the panel (:mod:`.widgets.figures`); this name is kept for importers outside ``tui/``."""

from .widgets.figures import Baseline, baseline_from_reply, baselines_from_bench, panel_values, speedup_vs  # noqa: F401
