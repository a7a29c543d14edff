"""Figures for the lessons. Each function returns a matplotlib ``Figure`` (the notebook
shows it; nothing is printed), with labelled axes and a title that states the point.
"""

from __future__ import annotations

import matplotlib.pyplot as plt  # noqa: F401  (used by the sections below)

# --- 01_number_formats ---------------------------------------------------------------

# --- 02_autocast ---------------------------------------------------------------------

# --- 03_grad_scaler ------------------------------------------------------------------

# --- 04_clipping ---------------------------------------------------------------------

# --- 05_putting_it_together ----------------------------------------------------------
