"""``pivotspec`` command line. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotspec.errors import UsageError

if TYPE_CHECKING:
    from pivotspec.decoding import Generation
    from pivotspec.models import LM


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a typo must not silently match a longer flag
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, not usage + message
        raise UsageError(f"{self.prog}: {message} (see --help)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: registered name, HF directory, .gguf file or cached hub id")
    g.add_argument("--draft", help="draft model sharing the target's tokenizer")
    g.add_argument("--pair", choices=["testbed"], help="shorthand for a registered target/draft pair")
    g.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--gamma", type=int, default=5, help="draft tokens per step (default 5)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--classifier", help="pivot classifier for --method pad: a directory from train-classifier, "
                   "or const:SCORE (a constant score, for ablations); with --pair testbed the shipped one by default")
    g.add_argument("--sigma", type=float, default=None,
                   help="PAD: override when pivot score <= sigma (0 = SD; default: the classifier's calibrated sigma, "
                   "0.5 for const:)")
    g.add_argument("--tau", type=float, default=1e-4, help="PAD: overrides need target prob >= tau")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pivotspec", description="Pivot-aware speculative decoding (PAD) on Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="decode prompts with ar, draft, sd or pad")
    add_model_args(gen)
    add_decoding_args(gen)
    gen.add_argument("--method", choices=["ar", "draft", "sd", "pad"], help="default: sd with a draft, else ar")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", type=Path,
                     help='JSONL, one {"prompt": ...} or {"messages": [...]} per line; models load once')
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, stats, trace")
    gen.set_defaults(func=cmd_generate)

    from pivotspec.evaluation import add_eval_parser
    add_eval_parser(sub)

    lab = sub.add_parser("label", help="label pivot tokens by Monte-Carlo rollouts of the target (resumable)")
    add_model_args(lab)
    lab.add_argument("--task", default="arith")
    lab.add_argument("--split", default="train")
    lab.add_argument("--n-problems", type=int, default=50)
    lab.add_argument("--rollouts", type=int, default=20, help="N rollouts after d and N after t (default 20)")
    lab.add_argument("--temperature", type=float, default=0.7)
    lab.add_argument("--top-p", type=float, default=1.0)
    lab.add_argument("--max-rollout-tokens", type=int, default=160)
    lab.add_argument("--max-walk-tokens", type=int, default=200)
    lab.add_argument("--mode", choices=["mul", "add", "abs"], default="mul",
                     help="mul: U_acc < alpha*U_rej; add: U_acc + alpha < U_rej; abs: U_acc < alpha")
    lab.add_argument("--alpha", type=float, default=0.5)
    lab.add_argument("--follow", choices=["label", "target"], default="label",
                     help="continue the walk with d when non-pivot (label) or always with t (target)")
    lab.add_argument("--min-target-rate", type=float, default=0.3,
                     help="skip problems the target solves at <= this rate from the prompt (-1: no screening)")
    lab.add_argument("--judge", help="local HF causal LM that may flip non-pivots to pivots (off by default)")
    lab.add_argument("--out", type=Path, required=True)
    lab.add_argument("--overwrite", action="store_true", help="start the file over instead of resuming")
    lab.add_argument("--seed", type=int, default=0)
    lab.set_defaults(func=cmd_label)

    demo = sub.add_parser("demo", help="the embedded testbed: ar, sd and pad side by side with a report")
    demo.add_argument("--n", type=int, default=20, help="arith test problems (default 20)")
    demo.add_argument("--out", type=Path, default=Path("pivotspec-demo"), help="report directory")
    demo.add_argument("--threads", type=int, default=None)
    demo.set_defaults(func=cmd_demo)

    from pivotspec.classifier_cli import add_parsers as add_classifier_parsers
    add_classifier_parsers(sub, add_model_args)

    labels = sub.add_parser("labels", help="inspect a labels file")
    labels_sub = labels.add_subparsers(dest="labels_command", required=True, parser_class=_Parser)
    st = labels_sub.add_parser("stats", help="counts, pivot share, U distributions, candidates per problem")
    st.add_argument("file", type=Path)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_labels_stats)
    return parser


def validate_decoding(args: argparse.Namespace) -> None:
    if args.gamma < 1:
        raise UsageError(f"--gamma must be >= 1, got {args.gamma}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from pivotspec.sampling import SamplingConfig

    SamplingConfig(args.temperature, args.top_k, args.top_p)  # raises UsageError on bad values


def resolve_pair(args: argparse.Namespace, needs_draft: bool) -> tuple[str, str | None]:
    target, draft = args.target, args.draft
    if args.pair == "testbed":
        target, draft = target or "testbed-target", draft or "testbed-draft"
    if not target:
        raise UsageError("no target model: pass --target MODEL or --pair testbed")
    if needs_draft and not draft:
        raise UsageError("this method needs a draft model: pass --draft MODEL or --pair testbed")
    return target, draft


def load_models(args: argparse.Namespace, needs_draft: bool) -> tuple[LM, LM | None]:
    """Load target (and draft) once; the draft must share the target's tokenizer."""
    from pivotspec.models import check_same_tokenizer, load_lm

    target_name, draft_name = resolve_pair(args, needs_draft)
    target = load_lm(target_name, args.dtype, args.threads)
    draft = load_lm(draft_name, args.dtype, args.threads) if draft_name else None
    if draft is not None:
        check_same_tokenizer(target, draft)
    return target, draft


def make_policy(args: argparse.Namespace, method: str, target: LM | None = None,
                sigma: float | None = None) -> Any:
    """The acceptance policy for ``method``; a trained classifier is checked against ``target``."""
    from pivotspec.acceptance import PAD, Lossless, constant_classifier

    if method != "pad":
        return Lossless()
    sigma = sigma if sigma is not None else args.sigma
    if not args.classifier and getattr(args, "pair", None) == "testbed":
        from pivotspec.testbed.artifacts import shipped_classifier

        args.classifier = str(shipped_classifier() or "") or None
    if not args.classifier:
        raise UsageError("--method pad needs a pivot classifier: pass --classifier DIR (or const:SCORE)")
    if args.classifier.startswith("const:"):
        try:
            score = float(args.classifier.split(":", 1)[1])
        except ValueError:
            raise UsageError(f"bad classifier {args.classifier!r}: write const:SCORE with SCORE in [0, 1]") from None
        return PAD(constant_classifier(score), sigma=0.5 if sigma is None else sigma, tau=args.tau)
    from pivotspec.classifier import load_for_target

    if target is None:
        from pivotspec.classifier import load

        load(Path(args.classifier))  # validates the directory before any model is loaded
        return None
    classify, config = load_for_target(Path(args.classifier), target)
    return PAD(classify, sigma=config["sigma"] if sigma is None else sigma, tau=args.tau,
               hidden_layer=config["layer"])


def read_prompts(path: Path) -> list[dict[str, Any]]:
    from pivotspec.store import read_user_jsonl

    prompts = read_user_jsonl(path, "prompts file")
    for n, obj in enumerate(prompts, 1):
        if not ({"prompt", "messages"} & obj.keys()):
            raise UsageError(f'{path}: record {n} needs a "prompt" or "messages" key')
    return prompts


def generation_json(gen: Generation, tokenizer: Any) -> dict[str, Any]:
    return {
        "text": gen.text,
        "token_ids": gen.token_ids,
        "stats": gen.stats,
        "trace": [{"id": t, "text": tokenizer.decode([t]), "source": s} for t, s in gen.trace],
    }


def cmd_generate(args: argparse.Namespace) -> None:
    from pivotspec.decoding import decode
    from pivotspec.models import eos_ids
    from pivotspec.sampling import SamplingConfig
    from pivotspec.tasks import encode_prompt

    validate_decoding(args)
    method = args.method or ("sd" if (args.draft or args.pair) else "ar")
    prompts = read_prompts(args.prompts_file) if args.prompts_file else [{"prompt": args.prompt}]
    make_policy(args, method)  # argument errors before the (slow) model loading
    target, draft = load_models(args, needs_draft=method != "ar")
    policy = make_policy(args, method, target)
    cfg = SamplingConfig(args.temperature, args.top_k, args.top_p)
    for item in prompts:
        ids = encode_prompt(target.tokenizer, item.get("prompt"), item.get("messages"), chat=args.chat)
        gen = decode(method, target, draft, ids, policy, cfg=cfg, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                     eos_ids=eos_ids(target), stop_strings=args.stop, seed=args.seed)
        if args.json:
            print(json.dumps(generation_json(gen, target.tokenizer)), flush=True)
        else:
            s = gen.stats
            print(gen.text, flush=True)
            tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
            eta = f"{s['eta']:.2f}" if s["eta"] is not None else "-"
            print(f"[{method}] {s['new_tokens']} tokens, {s['wall_s']:.2f}s, tau {tau}, eta {eta}", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> None:
    """eval --pair testbed on arith test problems, with the shipped classifier when there is one."""
    from pivotspec.evaluation import evaluate, format_table, parse_specs
    from pivotspec.tasks import get_task
    from pivotspec.testbed.artifacts import shipped_classifier

    clf_dir = shipped_classifier()
    methods = "ar,sd,pad" if clf_dir else "ar,sd"
    ns = build_parser().parse_args(["eval", "--pair", "testbed", "--methods", methods, "--n", str(args.n),
                                    "--out", str(args.out), "--overwrite"]
                                   + (["--classifier", str(clf_dir)] if clf_dir else [])
                                   + (["--threads", str(args.threads)] if args.threads else []))
    if not clf_dir:
        print("pivotspec: note: no pivot classifier is shipped yet, so the demo runs ar and sd only",
              file=sys.stderr)
    task = get_task("arith")
    target, draft = load_models(ns, needs_draft=True)
    summary = evaluate(ns, task, task.problems("test", args.n, 0), parse_specs(ns, target), target, draft)
    print(format_table(summary))
    print(f"report: {(args.out / 'report.html').resolve()}")


def cmd_label(args: argparse.Namespace) -> None:
    from pivotspec.labeling import LabelConfig, label_stats, run_labeling
    from pivotspec.models import load_lm
    from pivotspec.tasks import get_task

    cfg = LabelConfig(rollouts=args.rollouts, temperature=args.temperature, top_p=args.top_p,
                      max_rollout_tokens=args.max_rollout_tokens, mode=args.mode, alpha=args.alpha,
                      follow=args.follow, min_target_rate=args.min_target_rate,
                      max_walk_tokens=args.max_walk_tokens, seed=args.seed)
    if args.n_problems < 1:
        raise UsageError(f"--n-problems must be >= 1, got {args.n_problems}")
    task = get_task(args.task)
    problems = task.problems(args.split, args.n_problems, args.seed)
    target, draft = load_models(args, needs_draft=True)
    judge = load_lm(args.judge, args.dtype) if args.judge else None
    records = run_labeling(target, draft, task, problems, cfg, args.out, overwrite=args.overwrite, judge=judge,
                           split=args.split)
    s = label_stats(records)
    print(f"{args.out}: {s['candidates']} candidates, {s['pivots']} pivots, "
          f"{s['problems_done']} problems done, {s['problems_skipped']} skipped")


def cmd_labels_stats(args: argparse.Namespace) -> None:
    from pivotspec.labeling import label_stats
    from pivotspec.store import read_records

    if not args.file.is_file():
        raise UsageError(f"labels file {str(args.file)!r} does not exist: check the path")
    s = label_stats(read_records(args.file, repair=False))
    if args.json:
        print(json.dumps(s))
        return
    share = "-" if s["pivot_share"] is None else f"{s['pivot_share']:.3f}"
    cpp = s["candidates_per_problem"]
    print(f"candidates {s['candidates']} | pivots {s['pivots']} (share {share}) | problems done "
          f"{s['problems_done']}, skipped {s['problems_skipped']} | rollouts {s['rollouts']}")
    print(f"candidates per problem: mean {cpp['mean']:.1f}, min {cpp['min']}, max {cpp['max']}")
    print("U bins  " + " ".join(f"{b:>5.1f}" for b in s["hist_bins"][:-1]))
    print("U_acc   " + " ".join(f"{c:>5d}" for c in s["u_acc_hist"]))
    print("U_rej   " + " ".join(f"{c:>5d}" for c in s["u_rej_hist"]))
    if s["rollouts_per_s"]:
        print(f"rollout time {s['rollout_s'] / 60:.1f} min, {s['rollouts_per_s']:.2f} rollouts/s "
              "(candidates that recorded it)")
    if s["candidates"]:
        print("pivot share by rule: " + ", ".join(f"{r['mode']} {r['alpha']:g}: {r['pivot_share']:.3f}"
                                                  for r in s["rule_sweep"]))


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except UsageError as exc:
        print(f"pivotspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pivotspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush is quiet too
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
