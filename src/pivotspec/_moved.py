"""Module paths of pivotspec 0.1 that moved when the package was grouped by stage.

``import pivotspec.acceptance`` (or any path in ``MOVED``) still works: it gives the module at its new
path, the same object, and warns once with the new name, so user code keeps running and says how to update.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

MOVED = {
    "acceptance": "decoding.acceptance", "baselines": "decoding.baselines", "drafting": "decoding.drafting",
    "kvcache": "decoding.kvcache", "models": "decoding.models", "sampling": "decoding.sampling",
    "labeling": "labels.walk", "rollouts": "labels.rollouts", "vllm_worker": "labels.vllm_worker",
    "cluster": "labels.cluster", "label_files": "labels.files",
    "features": "classifier.features", "metrics": "classifier.metrics", "classifier_training": "classifier.training",
    "reports": "evaluation.reports", "sandbox": "tasks.sandbox",
    "cli_common": "cli.common", "labels_cli": "cli.labels", "classifier_cli": "cli.classifier",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(self.new)

    def exec_module(self, module: Any) -> None:  # the new module is already executed
        pass


class MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, old = fullname.partition(".")
        if prefix != "pivotspec" or old not in MOVED:
            return None
        new = f"pivotspec.{MOVED[old]}"
        warnings.warn(f"{fullname} moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
