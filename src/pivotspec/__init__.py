"""pivotspec: pivot-aware speculative decoding (PAD) for Hugging Face causal LMs.

The documented surface (see README, "Python API") is ``pivotspec.api``, re-exported here: ``load_pair``,
``generate``, ``evaluate``, ``label``, ``label_on_ray``, ``train_classifier``, ``evaluate_classifier``, and
``Pair`` / ``EvalSettings``. The packages follow the pipeline: ``decoding`` (the core), ``labels``,
``classifier``, ``evaluation`` (with ``tasks`` below them all), then the entry points ``cli`` and ``server``.
"""

from importlib.metadata import PackageNotFoundError, version

from pivotspec import _moved
from pivotspec.api import (
    EvalSettings,
    Pair,
    evaluate,
    evaluate_classifier,
    generate,
    label,
    label_on_ray,
    load_pair,
    train_classifier,
)
from pivotspec.testbed.artifacts import register as _register_testbed

try:
    __version__ = version("pivotspec")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

_register_testbed()
_moved.install()  # old module paths (pivotspec.acceptance, ...) still import, with a pointer to the new one

__all__ = ["EvalSettings", "Pair", "evaluate", "evaluate_classifier", "generate", "label", "label_on_ray", "load_pair",
           "train_classifier", "__version__"]
