"""The vLLM side of ``rollouts.VllmEngine``: a child process holding one offline ``vllm.LLM``.

Run by path with the interpreter of an environment that has vLLM (which may lack pivotspec, so this file
imports nothing from it). Protocol, one JSON object per line: argv[1] holds the engine options; the worker
answers ``{"vllm": version}`` once loaded, then for each request line ``{"prompts": [[ids]], "n": [k],
"temperature", "top_p", "top_k", "max_tokens", "stop_token_ids"}`` (optionally ``"extra_args": [{...}]``, one
per prompt: vLLM's ``SamplingParams.extra_args``, which the PAD plugin reads) writes ``{"outputs": [[[ids] * k]],
"spec": {...}}`` (``spec``: vLLM's ``vllm:spec_decode_*`` counters so far, when it keeps stats); any failure is
one ``{"error": "..."}`` line. It exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import sys


def protocol_stream():
    """Keep the real stdout for protocol lines and point fd 1 at stderr, so anything vLLM or its engine
    process prints cannot corrupt the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def serve(options: dict, inbox, out) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args = {k: v for k, v in options.items() if k not in ("model", "seed", "dtype", "max_model_len")}
    engine_args.setdefault("disable_log_stats", False)  # the spec-decode counters come from its stats
    llm = LLM(model=options["model"], tokenizer=options["model"], seed=options.get("seed", 0),
              dtype=options.get("dtype", "float32"), max_model_len=options.get("max_model_len", 2048),
              enable_prefix_caching=True, skip_tokenizer_init=True, **engine_args)
    import vllm

    out.write(json.dumps({"vllm": vllm.__version__}) + "\n")
    for line in inbox:
        req = json.loads(line)
        extra = req.get("extra_args") or [None] * len(req["n"])
        params = [SamplingParams(n=k, temperature=req["temperature"], top_p=req["top_p"],
                                 top_k=req["top_k"] if req.get("top_k") else -1, max_tokens=req["max_tokens"],
                                 stop_token_ids=req["stop_token_ids"], detokenize=False,
                                 **({"extra_args": x} if x else {}))  # only what a request sets
                  for k, x in zip(req["n"], extra, strict=True)]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]]
        results = llm.generate(prompts, params, use_tqdm=False)
        out.write(json.dumps({"outputs": [[list(c.token_ids) for c in r.outputs] for r in results],
                              "spec": spec_counters(llm)}) + "\n")


def spec_counters(llm) -> dict:
    """vLLM's own speculative-decoding counters (drafts, draft tokens, accepted tokens), summed over engines."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # stats off, or an engine without them
        return {}
    out = {}
    for m in metrics:
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def main() -> None:
    out = protocol_stream()
    try:
        serve(json.loads(sys.argv[1]), sys.stdin, out)
    except Exception as exc:  # the parent turns this line into its one-line error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        out.write(json.dumps({"error": f"{type(exc).__name__}: {first}"}) + "\n")
        raise


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this module
    main()
