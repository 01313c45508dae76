"""The API's other engines: PAD inside vLLM (``integrations.vllm``) for generate, eval and serve."""

from __future__ import annotations

from typing import Any

from pivotspec.api.pairs import Pair, default_classifier, get_task
from pivotspec.decoding.acceptance import PAD
from pivotspec.decoding.models import eos_ids
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.errors import UsageError
from pivotspec.evaluation.runs import EvalSettings, MethodSpec

ENGINES = ("torch", "vllm")


def check_engine(engine: str, method: str, classifier: str | None = None) -> None:
    """What the vLLM engine runs: ar, sd and pad with a trained classifier (one-line errors otherwise)."""
    from pivotspec.integrations.vllm.launch import METHODS

    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r}: choose {' or '.join(ENGINES)}")
    if engine == "vllm" and method not in METHODS:
        raise UsageError(f"method {method!r} does not run in vLLM (it runs {', '.join(METHODS)}): use --engine torch")
    if engine == "vllm" and classifier and classifier.startswith("const:"):
        raise UsageError("the vLLM engine runs trained classifiers only: pass --classifier DIR")


def vllm_decoder(pair: Pair, method: str, *, classifier: str | None = None, sigma: float | None = None,
                 p_floor: float | None = None, gamma: int = 5, seed: int = 0) -> Any:
    """A vLLM engine decoding ``method`` for the pair (``integrations.vllm.launch.VllmDecoder``: ``decode`` and
    ``decode_many`` of token ids, ``close``); pad reads ``classifier`` (default: the pair's shipped one)."""
    from pivotspec.integrations.vllm.launch import VllmDecoder

    check_engine("vllm", method, classifier)
    if method == "pad":
        classifier = classifier or default_classifier(pair.name)
    return VllmDecoder(method, str(pair.target.source), str(pair.draft.source) if pair.draft else None,
                       pair.target.tokenizer, gamma=gamma, classifier=classifier, sigma=sigma, p_floor=p_floor,
                       seed=seed)


def vllm_generate(pair: Pair, prompts: list[list[int]], method: str, *, max_new_tokens: int = 128,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, **decoder_settings: Any) -> list[Any]:
    """Token-id prompts through one vLLM engine as one batch (``vllm_decoder``'s settings); Generations whose
    stats are the batch's."""
    cfg = SamplingConfig(temperature, top_k, top_p)
    decoder = vllm_decoder(pair, method, **decoder_settings)
    try:
        return decoder.decode_many(prompts, cfg, max_new_tokens, eos_ids(pair.target))
    finally:
        decoder.close()


def vllm_decoders(pair: Pair, specs: list[MethodSpec], st: EvalSettings) -> dict[str, Any]:
    """An evaluation's decoders: one vLLM engine per method (every pad sigma shares one: sigma and the floor
    travel with each request)."""
    if st.stop or getattr(get_task(st.task, st.data), "stop_strings", None):
        raise UsageError("the vLLM engine stops on tokens only: this task or --stop needs stop strings, use --engine "
                         "torch")
    for s in specs:
        check_engine(st.engine, s.method, st.classifier)
        if (s.method == "pad" and not isinstance(s.policy, PAD)) or s.gamma is not None:
            raise UsageError(f"{s.label!r} does not run in vLLM (per-token PAD with the run's --gamma does): use "
                             "--engine torch for it")
    decoders: dict[str, Any] = {}
    out = {}
    for s in specs:
        if s.method not in decoders:
            decoders[s.method] = vllm_decoder(pair, s.method, classifier=st.classifier, gamma=st.gamma, seed=st.seed)
        out[s.label] = decoders[s.method]
    return out


def vllm_server(target: str, draft: str | None, *, method: str = "pad", classifier: str | None = None,
                sigma: float | None = None, p_floor: float | None = None, gamma: int = 5, host: str = "127.0.0.1",
                port: int = 8000, served_name: str | None = None, extra_args: list[str] = (),
                pair_name: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(command, environment to add) that starts vLLM's own OpenAI server for the pair, PAD inside it for pad."""
    from pivotspec.integrations.vllm.launch import server_command

    check_engine("vllm", method, classifier)
    if method == "pad":
        classifier = classifier or default_classifier(pair_name)
    return server_command(target, draft, method=method, gamma=gamma, classifier=classifier, sigma=sigma,
                          p_floor=p_floor, host=host, port=port, served_name=served_name, extra_args=extra_args)
