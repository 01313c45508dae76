"""pivotspec: pivot-aware speculative decoding (PAD) for Hugging Face causal LMs.

The documented surface (see README, "Python API"): ``load_pair``, ``generate``, ``evaluate``, ``label``,
``train_classifier``, and ``Pair`` / ``EvalSettings``.
"""

from importlib.metadata import PackageNotFoundError, version

from pivotspec.api import Pair, evaluate, generate, label, label_on_ray, load_pair, train_classifier
from pivotspec.evaluation import EvalSettings
from pivotspec.testbed.artifacts import register as _register_testbed

try:
    __version__ = version("pivotspec")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

_register_testbed()

__all__ = ["EvalSettings", "Pair", "evaluate", "generate", "label", "label_on_ray", "load_pair", "train_classifier",
           "__version__"]
