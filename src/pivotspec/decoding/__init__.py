"""Decoding core: from prompt ids to output tokens, one target forward per step.

Owns the models and their roll-back caches (``models``, ``kvcache``), turning logits into distributions and
tokens (``sampling``), the draft's proposal (``drafting``), verification and the acceptance policies
(``acceptance``: lossless SD and PAD; ``baselines``: the training-free relaxed rules), and the loop that ties them
(``loop``). It imports only the base (``pivotspec.errors``) and third-party libraries: it knows nothing of
tasks, labels, classifier training or files, so every stage above reads the same loop.
"""

from pivotspec.decoding.loop import METHODS, Generation, decode, generate

__all__ = ["METHODS", "Generation", "decode", "generate"]
