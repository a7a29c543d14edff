import os

import matplotlib
import pytest

os.environ.setdefault("AMP_LESSONS_PROGRESS", "0")
matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _seeded():
    from amp_lessons import seed_everything

    seed_everything(0)
