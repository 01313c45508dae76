"""The Python API: load a pair, decode, evaluate, label, train a classifier. The CLI and the server call only this.

    import pivotspec
    pair = pivotspec.load_pair(pair="testbed")                    # or load_pair("target/dir", "draft/dir")
    out = pivotspec.generate(pair, "Mia has 3 apples ...", method="pad", gamma=5)
    out.text, out.token_ids, out.stats["tau"], out.trace
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotspec.errors import UsageError
from pivotspec.evaluation import EvalSettings, MethodSpec, method_specs
from pivotspec.policies import make_policy

if TYPE_CHECKING:
    from pivotspec.decoding import Generation
    from pivotspec.models import LM


@dataclass
class Pair:
    """A target, optionally a draft sharing its tokenizer, and the registered pair name they came from."""

    target: LM
    draft: LM | None = None
    name: str | None = None  # e.g. "testbed": lets PAD find the pair's shipped classifier


def resolve_names(target: str | None, draft: str | None, pair: str | None,
                  needs_draft: bool = False) -> tuple[str, str | None]:
    """Model specs from explicit names and/or a registered pair name (explicit names win)."""
    from pivotspec.models import PAIRS

    if pair is not None:
        if pair not in PAIRS:
            raise UsageError(f"unknown pair {pair!r}: choose one of {', '.join(sorted(PAIRS))}")
        target, draft = target or PAIRS[pair].target, draft or PAIRS[pair].draft
    if not target:
        raise UsageError("no target model: pass --target MODEL or --pair testbed")
    if needs_draft and not draft:
        raise UsageError("this method needs a draft model: pass --draft MODEL or --pair testbed")
    return target, draft


def load_pair(target: str | None = None, draft: str | None = None, *, pair: str | None = None,
              dtype: str | None = None, device: str | None = None, threads: int | None = None,
              needs_draft: bool = False) -> Pair:
    """Load a target (and draft) once onto ``device`` (default auto: CUDA when available, else CPU); ``dtype``
    defaults to bfloat16 on CUDA, float32 elsewhere. A draft must share the target's tokenizer (checked)."""
    from pivotspec.models import check_same_tokenizer, load_lm

    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    target_name, draft_name = resolve_names(target, draft, pair, needs_draft)
    t = load_lm(target_name, dtype, threads, device)
    d = load_lm(draft_name, dtype, threads, device) if draft_name else None
    if d is not None:
        check_same_tokenizer(t, d)
    return Pair(t, d, pair)


def check_decoding(gamma: int = 5, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, stop: list[str] | None = None) -> None:
    """Decoding settings that cannot work, as one-line errors (before any model loads)."""
    from pivotspec.sampling import SamplingConfig

    if gamma < 1:
        raise UsageError(f"--gamma must be >= 1, got {gamma}")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if any(s == "" for s in stop or []):
        raise UsageError("--stop needs a non-empty string (an empty one would stop after the first token)")
    SamplingConfig(temperature, top_k, top_p)


def generate(pair: Pair, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
             method: str | None = None, classifier: str | None = None, sigma: float | None = None,
             tau: float = 1e-4, policy: Any = None, gamma: int = 5, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop: list[str] | None = None, chat: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, on_step: Any = None) -> Generation:
    """Decode one prompt (text, or chat ``messages``). ``method``: ar, draft, sd or pad (default: sd with a
    draft, else ar); ``policy`` overrides the acceptance rule (e.g. a baseline). Returns text, token ids,
    stats (tau, eta, forwards, timings) and the per-token trace (token id, source). ``on_step(pairs)``
    sees each step's new (token id, source) pairs as they come; returning False stops the decode."""
    from pivotspec.decoding import decode
    from pivotspec.models import eos_ids
    from pivotspec.sampling import SamplingConfig
    from pivotspec.tasks import encode_prompt

    if prompt is None and messages is None:
        raise UsageError("give a prompt or messages")
    check_decoding(gamma, max_new_tokens, temperature, top_k, top_p, stop)
    method = method or ("sd" if pair.draft is not None else "ar")
    if method != "ar" and pair.draft is None:
        raise UsageError(f"method {method!r} needs a draft model: load the pair with a draft")
    if policy is None:
        policy = make_policy(method, pair.target, classifier=classifier, sigma=sigma, tau=tau, pair=pair.name)
    ids = encode_prompt(pair.target.tokenizer, prompt, messages, chat, chat_template_kwargs)
    return decode(method, pair.target, pair.draft, ids, policy, cfg=SamplingConfig(temperature, top_k, top_p),
                  gamma=gamma, max_new_tokens=max_new_tokens, eos_ids=eos_ids(pair.target), stop_strings=stop,
                  seed=seed, on_step=on_step)


def evaluate(pair: Pair, settings: EvalSettings | None = None, *, methods: str = "ar,sd",
             sigmas: list[float] | None = None, baselines: list[str] = (), classifier: str | None = None,
             sigma: float | None = None, tau: float = 1e-4, specs: list[MethodSpec] | None = None,
             **setting_overrides: Any) -> dict[str, dict[str, Any]]:
    """Methods side by side on a task (``settings``, or its fields as keywords: task, n, split, out, ...).
    Returns the summary per method; with ``out`` also writes results.jsonl, summaries and the report."""
    from dataclasses import replace

    from pivotspec.evaluation import evaluate as run
    from pivotspec.tasks import get_task

    st = replace(settings or EvalSettings(), **setting_overrides)
    check_decoding(st.gamma, st.max_new_tokens, st.temperature, st.top_k, st.top_p, st.stop)
    if st.n < 1:
        raise UsageError(f"--n must be >= 1, got {st.n}")
    classifier = classifier or st.classifier
    if specs is None:
        specs = method_specs(methods, pair.target, sigmas=sigmas, baselines=list(baselines), classifier=classifier,
                             sigma=sigma, tau=tau, pair=pair.name)
    if any(s.method != "ar" for s in specs) and pair.draft is None:
        raise UsageError("these methods need a draft model: load the pair with a draft")
    if classifier is None and any(s.method == "pad" for s in specs):
        from pivotspec.policies import default_classifier

        classifier = default_classifier(pair.name)
    st = replace(st, classifier=classifier)
    task = get_task(st.task, st.data)
    target = None if all(s.method == "draft" for s in specs) else pair.target
    return run(st, task, task.problems(st.split, st.n, st.seed), specs, target, pair.draft)


def label(pair: Pair, out: str | Path, *, task: str = "arith", split: str = "train", n_problems: int = 50,
          overwrite: bool = False, judge: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
          shard: tuple[int, int] | None = None, concurrency: int = 1, **label_config: Any) -> list[dict[str, Any]]:
    """Pivot labels by target rollouts into the JSONL file ``out`` (resumable); ``label_config``: the
    fields of ``labeling.LabelConfig`` (rollouts, temperature, mode, alpha, ...); ``shard=(i, n)`` labels only
    the problems of shard i of n (join the files with ``label_files.merge_labels``); ``concurrency``: problems
    walked side by side, their rollouts batched together (faster; 1 reproduces bit for bit whatever the
    sharding). Returns all records."""
    from pivotspec.label_files import in_shard
    from pivotspec.labeling import LabelConfig, run_labeling
    from pivotspec.models import load_lm
    from pivotspec.tasks import get_task

    cfg = LabelConfig(**label_config)
    if n_problems < 1:
        raise UsageError(f"--n-problems must be >= 1, got {n_problems}")
    if pair.draft is None:
        raise UsageError("labeling needs a draft model: load the pair with a draft")
    t = get_task(task)
    problems = [p for i, p in enumerate(t.problems(split, n_problems, cfg.seed)) if in_shard(i, shard)]
    judge_lm = load_lm(judge) if judge else None
    return run_labeling(pair.target, pair.draft, t, problems, cfg, Path(out), overwrite=overwrite, judge=judge_lm,
                        split=split, chat_template_kwargs=chat_template_kwargs, concurrency=concurrency)


def label_on_ray(out: str | Path, *, target: str | None = None, draft: str | None = None, pair: str | None = None,
                 dtype: str | None = None, device: str | None = None, threads: int | None = None, workers: int = 2,
                 address: str | None = None, overwrite: bool = False, **label_args: Any) -> dict[str, int]:
    """``label`` spread over a Ray cluster (``address``, or a local one): ``workers`` shards, each a Ray task
    that loads the pair itself and resumes from its shard file; merged into ``out`` at the end. Takes model
    names, not a loaded pair, because the models are loaded where the tasks run. Returns the merge counts."""
    from pivotspec.cluster import label_on_ray as run
    from pivotspec.cluster import shard_path

    resolve_names(target, draft, pair, needs_draft=True)  # unknown names fail here, not in every worker
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    out = Path(out)
    if overwrite:
        for path in [out] + [shard_path(out, i, workers) for i in range(workers)]:
            path.unlink(missing_ok=True)
    pair_args = dict(target=target, draft=draft, pair=pair, dtype=dtype, device=device, threads=threads)
    return run(pair_args, out, workers, label_args, address=address)


def train_classifier(pair: Pair, labels: str | Path, out: str | Path, *, overwrite: bool = False,
                     **options: Any) -> dict[str, Any]:
    """Train, calibrate and save a pivot classifier (``classifier_training.train_from_labels`` options:
    kind, layer, target_recall, epochs, seed, split_seed, filters, compare_types). Returns its config."""
    from pivotspec.classifier import CONFIG
    from pivotspec.classifier_training import train_from_labels
    from pivotspec.store import check_output_dir

    check_output_dir(Path(out), overwrite, CONFIG)
    return train_from_labels(Path(labels), pair.target, Path(out), draft=pair.draft, **options)
