"""The Python API: load a pair, decode, evaluate, label, train and evaluate a classifier.

    import pivotspec
    pair = pivotspec.load_pair(pair="testbed")                    # or load_pair("target/dir", "draft/dir")
    out = pivotspec.generate(pair, "Mia has 3 apples ...", method="pad", gamma=5)
    out.text, out.token_ids, out.stats["tau"], out.trace

The command line, the server and the benchmarks call only this package (and ``pivotspec.errors``): ``pairs``
(models and tasks by name), ``decoding``, ``evaluation``, ``labels``, ``classifier`` and ``engines`` (PAD inside
vLLM), all re-exported here.
Each argument is checked here once: every ``check_*`` function runs before any model loads, and the function it
guards runs it again, so a Python caller who skips it gets the same one-line errors.
"""

from __future__ import annotations

from pivotspec.api.classifier import check_train_classifier, evaluate_classifier, train_classifier
from pivotspec.api.decoding import (
    check_decoding,
    check_request,
    decode_method,
    generate,
    generate_many,
    make_policy,
    make_request,
    new_batch,
    read_prompts,
)
from pivotspec.api.engines import ENGINES, check_engine, vllm_decoder, vllm_generate, vllm_server
from pivotspec.api.evaluation import (
    check_evaluate,
    evaluate,
    format_cell,
    format_paired,
    format_table,
    method_specs,
    read_results,
    summarize,
)
from pivotspec.api.labels import (
    check_label,
    count_labels,
    label,
    label_config,
    label_on_ray,
    labels_dtype,
    labels_stats,
    merge_labels,
    rollout_policy,
)
from pivotspec.api.pairs import (
    Pair,
    default_classifier,
    encode,
    get_task,
    load_model,
    load_pair,
    make_pair,
    model_dir,
    pair_names,
    pair_task,
    resolve_names,
    stop_ids,
    task_for,
)
from pivotspec.classifier.model import TYPES as CLASSIFIER_TYPES
from pivotspec.decoding.acceptance import DEFAULT_P_FLOOR
from pivotspec.decoding.export import full_vocab_checkpoint
from pivotspec.decoding.fastpath import capabilities as cpu_capabilities
from pivotspec.decoding.loop import METHODS, Generation
from pivotspec.decoding.sampling import derive_seed
from pivotspec.evaluation.runs import EvalSettings, MethodSpec
from pivotspec.evaluation.summary import mcnemar_exact, wilson_ci

__all__ = [
    "derive_seed",
    "mcnemar_exact",
    "wilson_ci",
    "CLASSIFIER_TYPES",
    "DEFAULT_P_FLOOR",
    "ENGINES",
    "EvalSettings",
    "Generation",
    "METHODS",
    "MethodSpec",
    "Pair",
    "check_decoding",
    "check_engine",
    "check_evaluate",
    "check_label",
    "check_request",
    "check_train_classifier",
    "count_labels",
    "cpu_capabilities",
    "decode_method",
    "default_classifier",
    "encode",
    "evaluate",
    "evaluate_classifier",
    "full_vocab_checkpoint",
    "format_cell",
    "format_paired",
    "format_table",
    "generate",
    "generate_many",
    "get_task",
    "label",
    "label_config",
    "label_on_ray",
    "labels_dtype",
    "labels_stats",
    "load_model",
    "load_pair",
    "make_pair",
    "make_policy",
    "make_request",
    "merge_labels",
    "method_specs",
    "model_dir",
    "new_batch",
    "pair_names",
    "pair_task",
    "read_prompts",
    "read_results",
    "resolve_names",
    "rollout_policy",
    "stop_ids",
    "summarize",
    "task_for",
    "train_classifier",
    "vllm_decoder",
    "vllm_generate",
    "vllm_server",
]
