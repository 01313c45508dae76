"""PAD inside an unmodified vLLM: a ``vllm.general_plugins`` entry point (``register``) that wraps vLLM's model
runner and rejection sampler so that the draft tokens pivotspec's classifier calls harmless are kept.

Off unless ``$PIVOTSPEC_VLLM_PAD`` names a classifier (``pivotspec serve/generate/eval --engine vllm`` set it for
the vLLM processes they start), so installing pivotspec beside vLLM changes nothing by itself. ``step`` judges a
step in pure torch with pivotspec's own policy objects; ``patches`` wires it into vLLM (the only module here that
imports vLLM); ``counters`` carries the override counts from the workers to ``/metrics``; ``launch`` is the
pivotspec side, which starts vLLM in its own environment.
"""

from __future__ import annotations


def register() -> None:
    """vLLM calls this in each of its processes (plugin loading); installs PAD when it is asked for."""
    from pivotspec.integrations.vllm.patches import install

    install()
