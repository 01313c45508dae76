"""Acceptance policies by name: what ``method``, ``classifier``, ``sigma`` or ``budget``, ``p_floor`` and a baseline
spec ask for.

``make_policy`` is the one place that turns those words into a policy for the decoding loop (lossless SD, PAD
with a classifier from its files, or a training-free baseline such as ``topk:k=3``), so the API, evaluation and
the server build the same thing from the same words. It sits above the decoding core and the classifier,
which it joins, and below the workflows that decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivotspec.classifier import drop
from pivotspec.classifier.model import load, load_for_target
from pivotspec.decoding.acceptance import DEFAULT_P_FLOOR, PAD, Budget, Lossless, constant_classifier
from pivotspec.decoding.baselines import BASELINES, make_baseline
from pivotspec.decoding.loop import METHODS
from pivotspec.decoding.models import PAIRS
from pivotspec.errors import UsageError


def default_classifier(pair: str | None) -> str | None:
    """The classifier shipped with a registered pair, if any."""
    registered = PAIRS.get(pair or "")
    path = registered.classifier() if registered and registered.classifier else None
    return str(path) if path else None


def is_baseline(method: str) -> bool:
    """A training-free baseline spec (``topk``, ``topk:k=3,ratio=0.2``) rather than a method name."""
    return method.partition(":")[0] in BASELINES


def make_policy(method: str, target: Any = None, *, classifier: str | None = None, sigma: float | None = None,
                p_floor: float = DEFAULT_P_FLOOR, pair: str | None = None, budget: float | None = None) -> Any:
    """The acceptance policy for ``method``: ar, draft and sd are lossless; a baseline spec is that baseline; ``pad``
    reads ``classifier``, a directory from train-classifier or ``const:SCORE`` (default: the pair's shipped
    one). With ``budget`` PAD keeps overrides while the answer's summed predicted drop stays within it
    (``acceptance.Budget``: the classifier's drop head; ``const:SCORE`` prices every override at SCORE) instead
    of the per-token sigma, or with ``sigma`` too, as well as it. With ``target=None`` a pad classifier's
    directory, sigma, budget and floor are only checked (argument errors before models load) and None is
    returned."""
    if is_baseline(method):
        return make_baseline(method)
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}: choose one of {', '.join(METHODS)} or a baseline "
                         f"({', '.join(BASELINES)})")
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
        if budget is not None:
            pivot = None if sigma is None else constant_classifier(score)
            return Budget(constant_classifier(score), budget=budget, p_floor=p_floor, pivot=pivot, sigma=sigma)
        return PAD(constant_classifier(score), sigma=0.5 if sigma is None else sigma, p_floor=p_floor)
    if target is None:
        _, config = load(Path(classifier))  # validates the directory before any model is loaded
        if budget is not None:
            drop.load(Path(classifier), config)  # the budget needs the drop head
            Budget(constant_classifier(0.0), budget=budget, p_floor=p_floor)  # validates the budget and the floor
        if sigma is not None:  # alone, or PAD's per-token rule inside the budget
            PAD(constant_classifier(0.0), sigma=sigma, p_floor=p_floor)  # validates sigma and the floor
        return None
    classify, config = load_for_target(Path(classifier), target)
    if budget is not None:
        price = drop.as_policy_drop(drop.load(Path(classifier), config).to(target.device))  # config checked above
        return Budget(price, budget=budget, p_floor=p_floor, hidden_layer=config["layer"],
                      pivot=None if sigma is None else classify, sigma=sigma)
    return PAD(classify, sigma=config["sigma"] if sigma is None else sigma, p_floor=p_floor,
               hidden_layer=config["layer"])
