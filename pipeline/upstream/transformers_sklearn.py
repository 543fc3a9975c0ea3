"""Upstream defect: `transformers.generation` imports scikit-learn whenever it is installed (MLflow depends on it),
for assisted generation's confidence threshold, which nothing here uses: about 2 s of CPU in every process that
loads a model, vLLM's engines included.

Targets: transformers 5.19 (`transformers.generation.candidate_generator`: `if is_sklearn_available(): from
sklearn.metrics import roc_curve`). No upstream issue filed from here.
Removable when: the import is lazy upstream; the test that says so is
`tests/test_upstream.py::test_transformers_generation_still_imports_sklearn_eagerly`.
"""

from __future__ import annotations

import sys


def hide_sklearn() -> None:
    """Tell transformers scikit-learn is absent, in this process (a worker's; the driver and a user's own code see it
    as installed). Call before transformers loads its generation utilities; later it is too late and does nothing."""
    if "transformers.generation" in sys.modules:  # too late: it has imported scikit-learn already
        return
    import transformers.utils
    import transformers.utils.import_utils as import_utils

    def absent() -> bool:
        return False

    import_utils.is_sklearn_available = absent  # what `transformers.generation` asks, by either name
    transformers.utils.is_sklearn_available = absent
