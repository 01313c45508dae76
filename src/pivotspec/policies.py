"""Acceptance policies by name: what `--method`, `--classifier`, `--sigma` and `--baseline` ask for.

One place turns those settings into a policy for the decoding loop, so the CLI, the server, the Python API
and the benchmarks build the same thing from the same words.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivotspec.errors import UsageError

METHODS = ("ar", "draft", "sd", "pad")


def default_classifier(pair: str | None) -> str | None:
    """The classifier shipped with a registered pair, if any."""
    from pivotspec.models import PAIRS

    registered = PAIRS.get(pair or "")
    path = registered.classifier() if registered and registered.classifier else None
    return str(path) if path else None


def make_policy(method: str, target: Any = None, *, classifier: str | None = None, sigma: float | None = None,
                tau: float = 1e-4, pair: str | None = None) -> Any:
    """The acceptance policy for ``method`` (ar, draft and sd: lossless). For ``pad``: ``classifier`` is a
    directory from train-classifier or ``const:SCORE``; without one, the pair's shipped classifier. With
    ``target=None`` the classifier's directory is only validated (argument errors before models load) and
    None is returned."""
    from pivotspec.acceptance import PAD, Lossless, constant_classifier

    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if method != "pad":
        return Lossless()
    classifier = classifier or default_classifier(pair)
    if not classifier:
        raise UsageError("--method pad needs a pivot classifier: pass --classifier DIR (or const:SCORE)")
    if classifier.startswith("const:"):
        try:
            score = float(classifier.split(":", 1)[1])
        except ValueError:
            raise UsageError(f"bad classifier {classifier!r}: write const:SCORE with SCORE in [0, 1]") from None
        return PAD(constant_classifier(score), sigma=0.5 if sigma is None else sigma, tau=tau)
    from pivotspec.classifier import load, load_for_target

    if target is None:
        load(Path(classifier))  # validates the directory before any model is loaded
        if sigma is not None:
            PAD(constant_classifier(0.0), sigma=sigma, tau=tau)  # validates sigma and tau
        return None
    classify, config = load_for_target(Path(classifier), target)
    return PAD(classify, sigma=config["sigma"] if sigma is None else sigma, tau=tau, hidden_layer=config["layer"])


def parse_floats(text: str, what: str) -> list[float]:
    """'0.3,0.5' -> [0.3, 0.5]; anything else is a one-line error naming the flag."""
    import math

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise UsageError(f"{what} must be comma-separated finite numbers, got {text!r}")
    return values
