"""The Python API: load a pair, decode, evaluate, label, train and evaluate a classifier.

    import pivotspec
    pair = pivotspec.load_pair(pair="testbed")                    # or load_pair("target/dir", "draft/dir")
    out = pivotspec.generate(pair, "Mia has 3 apples ...", method="pad", gamma=5)
    out.text, out.token_ids, out.stats["tau"], out.trace

The command line, the server and the benchmarks call only this module (and ``pivotspec.errors``). Each
argument is checked here once: every ``check_*`` function runs before any model loads, and the function it
guards runs it again, so a Python caller who skips it gets the same one-line errors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pivotspec import policies
from pivotspec.classifier.model import CONFIG as CLASSIFIER_CONFIG
from pivotspec.classifier.model import TYPES as CLASSIFIER_TYPES
from pivotspec.classifier.model import load as load_classifier
from pivotspec.classifier.training import Filters, evaluate_on_labels, probability_properties, train_from_labels
from pivotspec.decoding.acceptance import DEFAULT_P_FLOOR
from pivotspec.decoding.batch import Batch, Request, decode_many
from pivotspec.decoding.loop import METHODS, Generation, check_fits, decode
from pivotspec.decoding.models import LM, PAIRS, check_same_tokenizer, eos_ids, load_lm, resolve
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.errors import UsageError
from pivotspec.evaluation import reports, runs, summary
from pivotspec.evaluation.runs import EvalSettings, MethodSpec
from pivotspec.labels import cluster, files
from pivotspec.labels.rollouts import ROLLOUT_GAMMA
from pivotspec.labels.walk import LabelConfig, run_labeling
from pivotspec.store import check_output_dir, ensure_writable_dir, read_records, read_user_jsonl
from pivotspec.tasks import Task, encode_prompt
from pivotspec.tasks import get_task as find_task

__all__ = ["CLASSIFIER_TYPES", "DEFAULT_P_FLOOR", "METHODS", "EvalSettings", "Generation", "MethodSpec", "Pair"]


@dataclass
class Pair:
    """A target, optionally a draft sharing its tokenizer, and the registered pair name they came from."""
    target: LM
    draft: LM | None = None
    name: str | None = None  # e.g. "testbed": lets PAD find the pair's shipped classifier


# --- pairs and models ---------------------------------------------------------------------------------------

def pair_names() -> list[str]:
    """The registered pairs (``testbed``, ``testbed-hard``, ...)."""
    return sorted(PAIRS)


def pair_task(pair: str | None) -> str | None:
    """The task a registered pair was trained for (None for pairs without one, or no pair)."""
    registered = PAIRS.get(pair or "")
    return registered.task if registered else None


def task_for(task: str | None, pair: str | None) -> str:
    """``task``, else the task the pair was trained for, else arith."""
    return task or pair_task(pair) or "arith"


def default_classifier(pair: str | None) -> str | None:
    """The pivot classifier shipped with a registered pair, if any."""
    return policies.default_classifier(pair)


def resolve_names(target: str | None, draft: str | None, pair: str | None,
                  needs_draft: bool = False) -> tuple[str, str | None]:
    """Model specs from explicit names and/or a registered pair name (explicit names win)."""
    if pair is not None:
        if pair not in PAIRS:
            raise UsageError(f"unknown pair {pair!r}: choose one of {', '.join(sorted(PAIRS))}")
        target, draft = target or PAIRS[pair].target, draft or PAIRS[pair].draft
    if not target:
        raise UsageError("no target model: pass --target MODEL or --pair testbed")
    if needs_draft and not draft:
        raise UsageError("this method needs a draft model: pass --draft MODEL or --pair testbed")
    return target, draft


def model_dir(name: str) -> Path | str:
    """Where a model spec's Hugging Face files are (a registered name is built or converted on first use), for
    tools that read them directly, such as a load generator's tokenizer."""
    return resolve(name)[0]


def load_pair(target: str | None = None, draft: str | None = None, *, pair: str | None = None,
              dtype: str | None = None, device: str | None = None, threads: int | None = None,
              needs_draft: bool = False, draft_dtype: str | None = None) -> Pair:
    """Load a target (and draft) once onto ``device`` (default auto: CUDA when available, else CPU); ``dtype``
    defaults to bfloat16 on CUDA, float32 elsewhere (``draft_dtype``: the draft's, default ``dtype``). A draft
    must share the target's tokenizer (checked)."""
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    target_name, draft_name = resolve_names(target, draft, pair, needs_draft)
    t = load_lm(target_name, dtype, threads, device)
    d = load_lm(draft_name, draft_dtype or dtype, threads, device) if draft_name else None
    return make_pair(t, d, pair)


def make_pair(target: LM, draft: LM | None = None, name: str | None = None) -> Pair:
    """A pair of models loaded elsewhere (``load_model``); the draft must share the target's tokenizer."""
    if draft is not None:
        check_same_tokenizer(target, draft)
    return Pair(target, draft, name)


def load_model(name: str, dtype: str | None = None, device: str | None = None) -> LM:
    """One model alone: a registered name, HF directory, .gguf file or cached hub id."""
    return load_lm(name, dtype, device=device)


def encode(lm: LM, prompt: str | None = None, messages: list[dict[str, str]] | None = None, chat: bool = True,
               chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The token ids ``generate`` decodes from: the chat template (with the assistant header) when ``chat``
    and the tokenizer has one, else the plain text."""
    return encode_prompt(lm.tokenizer, prompt, messages, chat, chat_template_kwargs)


def stop_ids(lm: LM) -> set[int]:
    """The token ids that end a completion (the tokenizer's and the generation config's EOS)."""
    return eos_ids(lm)


# --- decoding -----------------------------------------------------------------------------------------------

def check_decoding(gamma: int = 5, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, stop: list[str] | None = None) -> None:
    """Decoding settings that cannot work, as one-line errors (before any model loads)."""
    if gamma < 1:
        raise UsageError(f"--gamma must be >= 1, got {gamma}")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if any(s == "" for s in stop or []):
        raise UsageError("--stop needs a non-empty string (an empty one would stop after the first token)")
    SamplingConfig(temperature, top_k, top_p)


def decode_method(method: str) -> str:
    """What the loop runs for ``method``: ar, draft, sd and pad as named; a baseline spec runs as pad (SD with
    an override policy)."""
    return "pad" if policies.is_baseline(method) else method


def make_policy(pair: Pair | None, method: str, *, classifier: str | None = None, sigma: float | None = None,
                p_floor: float = DEFAULT_P_FLOOR, pair_name: str | None = None) -> Any:
    """The acceptance policy ``method`` names (ar, draft, sd, pad or a baseline spec such as ``topk:k=3``).
    With ``pair=None`` only the arguments are checked (a pad classifier's files included; ``pair_name``
    finds a registered pair's shipped classifier) and None is returned for pad."""
    target, name = (pair.target, pair.name) if pair is not None else (None, pair_name)
    return policies.make_policy(method, target, classifier=classifier, sigma=sigma, p_floor=p_floor, pair=name)


def make_request(pair: Pair, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 prompt_ids: list[int] | None = None, method: str | None = None, classifier: str | None = None,
                 sigma: float | None = None, p_floor: float = DEFAULT_P_FLOOR, policy: Any = None, gamma: int = 5,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, stop: list[str] | None = None, chat: bool = True,
                 chat_template_kwargs: dict[str, Any] | None = None, on_step: Any = None) -> Request:
    """One decode's checked settings, as a row a batch can take (``new_batch``; method ``draft`` rows go to the
    batch made with ``draft_only``). The arguments are ``generate``'s."""
    if prompt is None and messages is None and prompt_ids is None:
        raise UsageError("give a prompt, messages or prompt ids")
    check_decoding(gamma, max_new_tokens, temperature, top_k, top_p, stop)
    method = method or ("sd" if pair.draft is not None else "ar")
    if method != "ar" and pair.draft is None:
        raise UsageError(f"method {method!r} needs a draft model: load the pair with a draft")
    if policy is None:
        policy = make_policy(pair, method, classifier=classifier, sigma=sigma, p_floor=p_floor)
    ids = prompt_ids or encode(pair.target, prompt, messages, chat, chat_template_kwargs)
    return Request(ids, policy=policy if decode_method(method) == "pad" else None,
                   cfg=SamplingConfig(temperature, top_k, top_p), gamma=gamma, max_new_tokens=max_new_tokens,
                   eos_ids=eos_ids(pair.target), stop_strings=list(stop or []), seed=seed,
                   speculate=decode_method(method) in ("sd", "pad"), on_step=on_step, method=method)


def check_request(pair: Pair, request: Request) -> None:
    """A UsageError if the row cannot decode on this pair (an empty prompt; prompt + budget past a model's
    positions), before it joins a batch."""
    check_fits(request.prompt_ids, request.max_new_tokens, pair.target, pair.draft)


def generate(pair: Pair, prompt: str | None = None, **settings: Any) -> Generation:
    """Decode one prompt (text, chat ``messages``, or token ``prompt_ids``). ``method``: ar, draft, sd, pad or a
    baseline spec (default: sd with a draft, else ar); ``policy`` (from ``make_policy``, or any acceptance
    policy) saves building it per call; ``classifier``, ``sigma`` and ``p_floor`` build PAD's. Also ``gamma``,
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``chat`` and
    ``chat_template_kwargs`` (see ``make_request``). Returns text, token ids, stats (tau = tokens per target
    forward, eta, forwards, timings) and the per-token trace (token id, source). ``on_step(pairs)`` sees each
    step's new (token id, source) pairs as they come; returning False stops the decode."""
    r = make_request(pair, prompt, **settings)
    return decode(decode_method(r.method), pair.target, pair.draft, r.prompt_ids, r.policy, cfg=r.cfg,
                  gamma=r.gamma, max_new_tokens=r.max_new_tokens, eos_ids=r.eos_ids, stop_strings=r.stop_strings,
                  seed=r.seed, on_step=r.on_step)


def new_batch(pair: Pair, draft_only: bool = False) -> Batch:
    """An empty batch over the pair (over the draft alone with ``draft_only``, for method ``draft``): rows from
    ``make_request`` join with ``add`` and advance together with ``step`` (see ``pivotspec.decoding.batch``)."""
    if draft_only and pair.draft is None:
        raise UsageError("method 'draft' needs a draft model: load the pair with a draft")
    return Batch(pair.draft, None) if draft_only else Batch(pair.target, pair.draft)


def generate_many(pair: Pair, prompts: list[Any], *, batch_size: int = 8, **settings: Any) -> list[Generation]:
    """Decode many prompts together, at most ``batch_size`` rows at a time (a finished row's place goes to the
    next prompt at once). Each prompt is a text, a chat message list or a list of token ids; ``settings`` are
    ``generate``'s and apply to every row. Greedy rows equal their ``generate`` output token for token."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    requests = []
    for p in prompts:
        key = "prompt" if isinstance(p, str) else "prompt_ids" if p and isinstance(p[0], int) else "messages"
        requests.append(make_request(pair, **{key: p}, **settings))
    draft_only = requests[0].method == "draft" if requests else False
    batch = new_batch(pair, draft_only)
    return decode_many(batch.target, requests, draft=batch.draft, max_batch=batch_size)


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL file of prompts, one ``{"prompt": ...}`` or ``{"messages": [...]}`` per line."""
    path = Path(path)
    prompts = read_user_jsonl(path, "prompts file")
    for n, obj in enumerate(prompts, 1):
        if not ({"prompt", "messages"} & obj.keys()):
            raise UsageError(f'{path}: record {n} needs a "prompt" or "messages" key')
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise UsageError(f'{path}: record {n}: "prompt" must be a string')
    return prompts


# --- evaluation ---------------------------------------------------------------------------------------------

def get_task(name: str, data: str | None = None) -> Task:
    """The task called ``name`` (arith, arith-hard, humaneval, gsm8k, mbpp, jsonl; ``data``: a local file)."""
    return find_task(name, data)


def method_specs(pair: Pair | None, methods: str = "ar,sd", *, sigmas: list[float] | None = None,
                 baselines: list[str] = (), classifier: str | None = None, sigma: float | None = None,
                 p_floor: float = DEFAULT_P_FLOOR, pair_name: str | None = None) -> list[MethodSpec]:
    """The labelled methods an evaluation runs (one pad per sigma, one per baseline spec); with
    ``pair=None`` only their arguments are checked (pad policies are None)."""
    return runs.method_specs(methods, pair.target if pair else None, sigmas=sigmas, baselines=list(baselines),
                 classifier=classifier, sigma=sigma, p_floor=p_floor, pair=pair.name if pair else pair_name)


def check_evaluate(settings: EvalSettings) -> Task:
    """An evaluation's settings, task, data file and output directory, before any model loads; returns the
    task (a file-backed one has read its file)."""
    check_decoding(settings.gamma, settings.max_new_tokens, settings.temperature, settings.top_k, settings.top_p,
                   settings.stop)
    if settings.n < 1:
        raise UsageError(f"--n must be >= 1, got {settings.n}")
    if settings.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {settings.batch_size}")
    task = get_task(settings.task, settings.data)
    if settings.out is not None:
        ensure_writable_dir(Path(settings.out))
    return task


def evaluate(pair: Pair, settings: EvalSettings | None = None, *, methods: str = "ar,sd",
             sigmas: list[float] | None = None, baselines: list[str] = (), classifier: str | None = None,
             sigma: float | None = None, p_floor: float = DEFAULT_P_FLOOR, specs: list[MethodSpec] | None = None,
             between: Any = None, **setting_overrides: Any) -> dict[str, dict[str, Any]]:
    """Methods side by side on a task (``settings``, or its fields as keywords: task, n, split, out, ...).
    ``specs`` (from ``method_specs``, or ``MethodSpec``s of your own, e.g. one gamma each) replaces the
    method arguments; ``between(done, total)`` runs after each problem, outside any timed decode. Returns the
    summary per method; with ``out`` also writes results.jsonl, summaries and the report."""
    st = replace(settings or EvalSettings(), **setting_overrides)
    classifier = classifier or st.classifier
    if specs is None:
        specs = method_specs(pair, methods, sigmas=sigmas, baselines=baselines, classifier=classifier,
                             sigma=sigma, p_floor=p_floor)
    task = check_evaluate(st)
    if any(s.method != "ar" for s in specs) and pair.draft is None:
        raise UsageError("these methods need a draft model: load the pair with a draft")
    if classifier is None and any(s.method == "pad" for s in specs):
        classifier = default_classifier(pair.name)
    st = replace(st, classifier=classifier)
    target = None if all(s.method == "draft" for s in specs) else pair.target
    return runs.evaluate(st, task, task.problems(st.split, st.n, st.seed), specs, target, pair.draft, between)


def summarize(rows: list[dict[str, Any]], references: tuple[str, ...] = ("ar", "sd")) -> dict[str, dict[str, Any]]:
    """An evaluation's summary from its rows (e.g. those of results.jsonl), each method compared, paired by
    problem, with each of ``references``."""
    return summary.summarize(rows, references=references)


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file that may still be being written (a torn last line is left out, not cut)."""
    return read_records(Path(path), repair=False)


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """An evaluation's summary as the Markdown table the CLI prints."""
    return reports.format_table(summary)


def format_cell(x: Any, spec: str, suffix: str = "") -> str:
    """One number of a summary as that table writes it (``-`` for None)."""
    return reports.fmt(x, spec, suffix)


def format_paired(comparison: dict[str, Any] | None) -> str:
    """A paired comparison (``summary[method]["paired"][reference]``) as that table writes it."""
    return reports.paired_cell(comparison)


# --- labels -------------------------------------------------------------------------------------------------

def label_config(**fields: Any) -> LabelConfig:
    """The labeling settings (``labels.walk.LabelConfig``: rollouts, temperature, mode, alpha, ...), checked."""
    return LabelConfig(**fields)


def rollout_policy(pair: Pair | None, fields: dict[str, Any],
                   pair_name: str | None = None) -> tuple[dict[str, Any], Any]:
    """Split ``label``'s keywords into the config's fields and the policy that rollouts and walk follow with
    ``rollout_policy="pad"`` (``policy_classifier``, default the pair's shipped one, and ``policy_sigma``,
    default its calibrated sigma). The config names the policy by sigma, floor, gamma and the classifier
    files' fingerprint, so files labeled under two policies never resume or merge into each other.
    ``follow`` defaults to "policy" then, else "label". With ``pair=None`` only the arguments are checked."""
    fields = dict(fields)
    clf, sigma = fields.pop("policy_classifier", None), fields.pop("policy_sigma", None)
    pad = fields.get("rollout_policy", "target") == "pad"
    if fields.get("follow") is None:
        fields["follow"] = "policy" if pad else "label"
    if not pad:
        if clf is not None or sigma is not None:
            raise UsageError("--policy-classifier and --policy-sigma go with --rollout-policy pad")
        return fields, None
    name = pair.name if pair is not None else pair_name
    clf = str(clf or default_classifier(name) or "")
    if not clf:
        raise UsageError("--rollout-policy pad needs a classifier: pass --policy-classifier DIR (this pair ships none)")
    policy = make_policy(pair, "pad", classifier=clf, sigma=sigma, pair_name=name)
    shown = f"{policy.sigma:g}" if policy is not None else "?"
    floor = policy.p_floor if policy is not None else DEFAULT_P_FLOOR
    fields["policy"] = (f"pad(sigma={shown},p_floor={floor:g},gamma={ROLLOUT_GAMMA}) "
                        f"{runs.classifier_files_fingerprint(clf)}")
    return fields, policy


def check_label(*, task: str = "arith", split: str = "train", n_problems: int = 50, overwrite: bool = False,
                judge: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                shard: str | tuple[int, int] | None = None, concurrency: int = 1, pair_name: str | None = None,
                **fields: Any) -> tuple[int, int] | None:
    """``label``'s arguments, before any model loads (``pair_name``: where a pad rollout policy finds its
    shipped classifier); returns the shard as (i, n) (``"I/N"`` accepted)."""
    label_config(**rollout_policy(None, fields, pair_name)[0])
    if n_problems < 1:
        raise UsageError(f"--n-problems must be >= 1, got {n_problems}")
    if concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {concurrency}")
    get_task(task)
    return files.parse_shard(shard) if isinstance(shard, str) else shard


def label(pair: Pair, out: str | Path, *, task: str = "arith", split: str = "train", n_problems: int = 50,
          overwrite: bool = False, judge: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
          shard: str | tuple[int, int] | None = None, concurrency: int = 1,
          **fields: Any) -> list[dict[str, Any]]:
    """Pivot labels by target rollouts into the JSONL file ``out`` (resumable); ``fields``: those of
    ``label_config`` (rollouts, temperature, mode, alpha, ...); ``shard=(i, n)`` or ``"I/N"`` labels only the
    problems of shard i of n (join the files with ``merge_labels``); ``concurrency``: problems walked side by
    side, their rollouts batched together (faster; 1 reproduces bit for bit whatever the sharding). Returns
    all records."""
    shard = check_label(task=task, split=split, n_problems=n_problems, concurrency=concurrency, shard=shard,
                        pair_name=pair.name, **fields)
    if pair.draft is None:
        raise UsageError("labeling needs a draft model: load the pair with a draft")
    t = get_task(task)
    fields, policy = rollout_policy(pair, fields)
    cfg = label_config(**fields)
    problems = [p for i, p in enumerate(t.problems(split, n_problems, cfg.seed)) if files.in_shard(i, shard)]
    judge_lm = load_lm(judge) if judge else None
    return run_labeling(pair.target, pair.draft, t, problems, cfg, Path(out), overwrite=overwrite, judge=judge_lm,
                        split=split, chat_template_kwargs=chat_template_kwargs, concurrency=concurrency,
                        policy=policy)


def _label_shard(pair_args: dict[str, Any], out: str, shard: tuple[int, int], label_args: dict[str, Any]) -> int:
    """One shard, in a Ray worker: load the pair there (models do not travel), label, count candidates."""
    pair = load_pair(**pair_args, needs_draft=True)
    records = label(pair, out, shard=shard, **label_args)
    return sum(r.get("type") == "candidate" for r in records)


def label_on_ray(out: str | Path, *, target: str | None = None, draft: str | None = None, pair: str | None = None,
                 dtype: str | None = None, device: str | None = None, threads: int | None = None, workers: int = 2,
                 address: str | None = None, overwrite: bool = False, **label_args: Any) -> dict[str, int]:
    """``label`` spread over a Ray cluster (``address``, or a local one): ``workers`` shards, each a Ray task
    that loads the pair itself and resumes from its shard file; merged into ``out`` at the end. Takes model
    names, not a loaded pair, because the models are loaded where the tasks run. Returns the merge counts."""
    resolve_names(target, draft, pair, needs_draft=True)  # unknown names fail here, not in every worker
    if label_args.pop("shard", None) is not None:
        raise UsageError("--ray makes its own shards: drop --shard (or run one shard per machine without --ray)")
    check_label(pair_name=pair, **label_args)
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    out = Path(out)
    if overwrite:
        for path in [out] + [cluster.shard_path(out, i, workers) for i in range(workers)]:
            path.unlink(missing_ok=True)
    pair_args = dict(target=target, draft=draft, pair=pair, dtype=dtype, device=device, threads=threads)
    return cluster.label_on_ray(_label_shard, pair_args, out, workers, label_args, address=address)


def labels_stats(path: str | Path, *, pair: str | None = None, target: str | None = None,
                 classifier: str | Path | None = None, device: str | None = None) -> dict[str, Any]:
    """Counts, pivot share, U distributions and candidates per problem of a labels file; with a target
    (``pair`` or ``target``) also how well p(d) alone, and ``classifier``, separate pivots (key ``p_d``)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"labels file {str(path)!r} does not exist: check the path")
    if classifier is not None and not (pair or target):
        raise UsageError("--classifier needs the target: pass --pair or --target")
    stats = files.label_stats(read_records(path, repair=False))
    if pair or target:
        lm = load_pair(target, pair=pair, device=device).target
        stats["p_d"] = probability_properties(path, lm, Path(classifier) if classifier else None)
    return stats


def merge_labels(out: str | Path, inputs: list[str | Path], overwrite: bool = False) -> dict[str, int]:
    """Join labels files of one run (e.g. shards) into ``out``, de-duplicated; returns the counts."""
    return files.merge_labels(Path(out), [Path(i) for i in inputs], overwrite)


def count_labels(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Candidates, pivots and problems done or skipped among a labeling run's records."""
    return files.label_stats(records)


# --- the classifier -----------------------------------------------------------------------------------------

def _check_labels_file(labels: Path) -> None:
    if not labels.is_file():
        raise UsageError(f"labels file {str(labels)!r} does not exist: check the path (or run `pivotspec label`)")


def check_train_classifier(labels: str | Path, out: str | Path, overwrite: bool = False, kind: str = "extended_v2",
                           target_recall: float = 0.95) -> None:
    """A labels file, a classifier directory that may be written and the settings, before any model loads."""
    _check_labels_file(Path(labels))
    if kind not in CLASSIFIER_TYPES:
        raise UsageError(f"unknown classifier type {kind!r}: choose one of {', '.join(CLASSIFIER_TYPES)}")
    if not 0 < target_recall <= 1:
        raise UsageError(f"--target-recall must be in (0, 1], got {target_recall}")
    check_output_dir(Path(out), overwrite, CLASSIFIER_CONFIG)


def train_classifier(pair: Pair, labels: str | Path, out: str | Path, *, overwrite: bool = False,
                     filters: dict[str, Any] | None = None, kind: str = "extended_v2", target_recall: float = 0.95,
                     **options: Any) -> dict[str, Any]:
    """Train, calibrate and save a pivot classifier (``classifier.training.train_from_labels`` options: layer,
    epochs, seed, split_seed, compare_types, progress; ``filters``: the fields of
    ``classifier.training.Filters``). Returns its config."""
    check_train_classifier(labels, out, overwrite, kind, target_recall)
    return train_from_labels(Path(labels), pair.target, Path(out), kind=kind, target_recall=target_recall,
                             draft=pair.draft, filters=Filters(**(filters or {})), **options)


def evaluate_classifier(classifier: str | Path, labels: str | Path, *, target: str | None = None,
                        draft: str | None = None, dtype: str | None = None, device: str | None = None,
                        out: str | Path | None = None, filters: dict[str, Any] | None = None) -> dict[str, Any]:
    """A classifier on every (filtered) candidate of a labels file: AUROC, PR-AUC, P/R/F1 per threshold, the
    stored references and ROC/PR plots in ``out`` (default: LABELS.eval-CLASSIFIER beside the labels; never
    the classifier's directory, which may be inside the installed package). ``config`` in the result is the
    classifier's own."""
    classifier, labels = Path(classifier), Path(labels)
    _, config = load_classifier(classifier)
    _check_labels_file(labels)
    if config["type"] == "extended" and not draft:
        raise UsageError("this classifier reads draft scalars: pass --draft")
    t = load_lm(target or config["target"]["name"], dtype, device=device)
    d = load_lm(draft, dtype, device=device) if config["type"] == "extended" else None
    plots = Path(out) if out else labels.with_name(f"{labels.stem}.eval-{classifier.name}")
    report = evaluate_on_labels(classifier, labels, t, d, plots, Filters(**(filters or {})))
    return {**report, "config": config}
