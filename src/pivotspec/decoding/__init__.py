"""Decoding core: from prompt ids to output tokens, one target forward per step.

Owns the models and their roll-back caches (``models``, ``kvcache``), one forward over a cache (``forward``:
transformers', or a lean Llama forward on the CPU fast path of ``fastpath``, ``packing`` and ``attention``, whose
C kernels, ``query_attention`` and ``rowwise``, ``compiled`` builds once per machine),
turning logits into distributions and
tokens (``sampling``), the draft's proposal (``drafting``), verification and the acceptance policies
(``acceptance``: lossless SD and PAD; ``baselines``: the training-free relaxed rules), and the loop that ties them
(``loop``), and the same loop over a batch of rows with per-row acceptance and continuous batching (``batch``,
over the per-row KV cache of ``slots``). It imports only the base (``pivotspec.errors``) and third-party
libraries: it knows nothing of tasks, labels, classifier training or files, so every stage above reads the same
loop.
"""

from pivotspec.decoding.batch import Batch, Request, decode_many
from pivotspec.decoding.loop import METHODS, Generation, decode, generate

__all__ = ["METHODS", "Batch", "Generation", "Request", "decode", "decode_many", "generate"]
