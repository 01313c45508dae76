"""``pivotspec`` command line: argument parsing and printing over the Python API (``pivotspec.api``).

Bad input ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pivotspec import api
from pivotspec.errors import UsageError
from pivotspec.models import PAIRS
from pivotspec.store import ensure_writable_dir

SPLITS = "train, validation or test (arith, arith-hard); test (humaneval, gsm8k, mbpp, jsonl: the file's rows)"
TASK_NAMES = "arith, arith-hard, humaneval, gsm8k, mbpp or jsonl (default: the --pair's task, else arith)"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default (flags whose default is None or False show none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a typo must not silently match a longer flag
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, not usage + message
        raise UsageError(f"{self.prog}: {message} (see --help)")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError(f"--chat-template-kwargs must be a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise UsageError(f"--chat-template-kwargs must be a JSON object, got {text!r}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: registered name, HF directory, .gguf file or cached hub id")
    g.add_argument("--draft", help="draft model sharing the target's tokenizer")
    g.add_argument("--pair", choices=sorted(PAIRS), help="shorthand for a registered target/draft pair (its task is "
                   "then the default --task)")
    g.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N or mps (default: $PIVOTSPEC_DEVICE, else "
                   "auto: CUDA if available, else CPU)")
    g.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, else "
                   "float32)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='extra variables for the chat template, e.g. \'{"enable_thinking": false}\' for Qwen3')


def add_decoding_args(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--gamma", type=int, default=5, help="draft tokens per step")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="token budget per completion")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (and problem order for eval)")
    g.add_argument("--classifier", help="pivot classifier for --method pad: a directory from train-classifier, "
                   "or const:SCORE (a constant score, for ablations); with an embedded --pair its shipped one")
    g.add_argument("--sigma", type=float, default=None,
                   help="PAD: override when pivot score <= sigma (0 = SD; default: the classifier's calibrated sigma, "
                   "0.5 for const:)")
    g.add_argument("--tau", type=float, default=1e-4, help="PAD: overrides need target prob >= tau")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    add_chat_args(p)


def _version() -> str:
    import pivotspec

    return pivotspec.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pivotspec", description="Pivot-aware speculative decoding (PAD) on Hugging Face causal LMs.")
    parser.add_argument("--version", action="version", version=f"pivotspec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

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

    ev = sub.add_parser("eval", help="run methods side by side on a task")
    add_model_args(ev)
    add_decoding_args(ev, max_new_tokens=200)
    ev.add_argument("--task", help=TASK_NAMES)
    ev.add_argument("--data", help="local data file for gsm8k, mbpp and jsonl (JSONL or parquet)")
    ev.add_argument("--split", default="test", help=SPLITS)
    ev.add_argument("--n", type=int, default=20, help="number of problems")
    ev.add_argument("--methods", default="ar,sd", help="comma list of ar, draft, sd, pad")
    ev.add_argument("--sigmas", help="PAD: one run per sigma, e.g. 0.3,0.5,0.7 (default: the calibrated sigma)")
    ev.add_argument("--baselines", help="relaxed rules at default knobs: typical,topk,threshold,ensemble,divergence")
    ev.add_argument("--baseline", action="append", default=[],
                    help="one relaxed rule with knobs, e.g. topk:k=3,ratio=0.2 (repeatable; default: none)")
    ev.add_argument("--no-chat", action="store_true", help="plain prompts instead of the chat template")
    ev.add_argument("--out", type=Path, help="write results.jsonl, summary.json/md, pareto.png, report.html here; "
                    "rerunning the same command resumes")
    ev.add_argument("--overwrite", action="store_true", help="start --out over instead of resuming")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)

    lab = sub.add_parser("label", help="label pivot tokens by Monte-Carlo rollouts of the target (resumable)")
    add_model_args(lab)
    lab.add_argument("--task", help=TASK_NAMES)
    lab.add_argument("--split", default="train", help=SPLITS)
    lab.add_argument("--n-problems", type=int, default=50, help="problems to walk")
    lab.add_argument("--rollouts", type=int, default=20, help="N rollouts after d and N after t")
    lab.add_argument("--temperature", type=float, default=0.7, help="rollout temperature")
    lab.add_argument("--top-p", type=float, default=1.0, help="rollout nucleus mass")
    lab.add_argument("--max-rollout-tokens", type=int, default=160, help="length cap of each rollout")
    lab.add_argument("--max-walk-tokens", type=int, default=200, help="length cap of the walked trajectory")
    lab.add_argument("--mode", choices=["mul", "add", "abs"], default="mul",
                     help="mul: U_acc < alpha*U_rej; add: U_acc + alpha < U_rej; abs: U_acc < alpha")
    lab.add_argument("--alpha", type=float, default=0.5, help="threshold of --mode")
    lab.add_argument("--follow", choices=["label", "target"], default="label",
                     help="continue the walk with d when non-pivot (label) or always with t (target)")
    lab.add_argument("--min-target-rate", type=float, default=0.3,
                     help="skip problems the target solves at <= this rate from the prompt (-1: no screening)")
    lab.add_argument("--judge", help="local HF causal LM that may flip non-pivots to pivots (off by default)")
    lab.add_argument("--out", type=Path, required=True, help="labels JSONL (appended; reruns resume)")
    lab.add_argument("--overwrite", action="store_true", help="start the file over instead of resuming")
    lab.add_argument("--seed", type=int, default=0, help="problem order and rollout seed")
    lab.add_argument("--shard", help="I/N: label only shard I of N of the problems (every N-th, from the I-th) into "
                     "--out; join the shard files with `pivotspec labels merge`")
    lab.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                     help="who samples the rollouts: pivotspec's torch loop, or vLLM (./install.sh --with-vllm, or "
                     "the official vllm on GPUs); the walk runs on torch either way")
    lab.add_argument("--concurrency", type=int, default=1, help="problems walked side by side, their rollouts "
                     "sampled in one batch (torch engine: ~1.5x the rollouts/s at 4 on a CPU; 1 reproduces a run "
                     "bit for bit whatever the sharding)")
    lab.add_argument("--ray", action="store_true", help="label --workers shards as Ray tasks and merge them into --out")
    lab.add_argument("--ray-address", help="an existing Ray cluster (e.g. ray://head:10001 or auto); default: a "
                     "local cluster started for the run")
    lab.add_argument("--workers", type=int, default=2, help="shards (Ray tasks) with --ray")
    add_chat_args(lab)
    lab.set_defaults(func=cmd_label)

    demo = sub.add_parser("demo", help="the embedded testbed: ar, sd and pad side by side with a report",
                          description="Decode test problems of an embedded pair's task (testbed: arith, "
                          "testbed-hard: arith-hard) with ar, sd and pad (the shipped classifier) and write a "
                          "report to --out. An --out that holds "
                          "anything but an earlier demo is refused unless --overwrite; an earlier demo there is "
                          "replaced.")
    demo.add_argument("--pair", default="testbed", help="an embedded pair: testbed (task arith) or testbed-hard "
                      "(task arith-hard; ar and sd only until its classifier ships)")
    demo.add_argument("--n", type=int, default=20, help="test problems of the pair's task")
    demo.add_argument("--out", type=Path, default=Path("pivotspec-demo"), help="report directory")
    demo.add_argument("--overwrite", action="store_true", help="replace whatever --out holds")
    demo.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    demo.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    add_chat_args(demo)
    demo.set_defaults(func=cmd_demo)

    srv = sub.add_parser("serve", help="an OpenAI-compatible server (chat/completions, completions, metrics)")
    add_model_args(srv)
    srv.add_argument("--method", default="pad", help="default method: ar, draft, sd, pad or a baseline spec "
                     "(requests may override with the extra field \"method\")")
    srv.add_argument("--classifier", help="pivot classifier for pad (default: the pair's shipped one)")
    srv.add_argument("--sigma", type=float, default=None, help="PAD sigma (default: the classifier's calibrated one)")
    srv.add_argument("--gamma", type=int, default=5, help="draft tokens per step")
    srv.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    srv.add_argument("--port", type=int, default=8000, help="TCP port")
    srv.add_argument("--max-queue", type=int, default=16, help="requests waiting behind the running one before 429")
    srv.add_argument("--max-tokens", type=int, default=256, help="completion budget when a request sets none")
    srv.add_argument("--api-key", help="require Authorization: Bearer KEY on every endpoint but /health")
    srv.add_argument("--model-name", help="the model id clients send (default: the target's name)")
    srv.set_defaults(func=cmd_serve)

    from pivotspec.classifier_cli import add_parsers as add_classifier_parsers
    add_classifier_parsers(sub, add_model_args)

    labels = sub.add_parser("labels", help="inspect a labels file")
    labels_sub = labels.add_subparsers(dest="labels_command", required=True, parser_class=_Parser,
                                       metavar="{stats,merge}", title="subcommands")
    st = labels_sub.add_parser("stats", help="counts, pivot share, U distributions, candidates per problem")
    st.add_argument("file", type=Path)
    st.add_argument("--json", action="store_true")
    st.add_argument("--pair", help="with a target (--pair or --target): also how well p(d) alone separates pivots")
    st.add_argument("--target", help="the target the labels were made with (see --pair)")
    st.add_argument("--classifier", type=Path, help="also this classifier's report-split AUROC (with a target)")
    st.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    st.set_defaults(func=cmd_labels_stats)
    mg = labels_sub.add_parser("merge", help="join labels files of one run (e.g. shards), de-duplicated")
    mg.add_argument("out", type=Path, help="merged labels file (written whole, then renamed)")
    mg.add_argument("inputs", type=Path, nargs="+", help="labels files to join")
    mg.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    mg.set_defaults(func=cmd_labels_merge)
    return parser


def load_pair(args: argparse.Namespace, needs_draft: bool) -> api.Pair:
    return api.load_pair(args.target, args.draft, pair=args.pair, dtype=args.dtype, threads=args.threads,
                         device=args.device, needs_draft=needs_draft)


def read_prompts(path: Path) -> list[dict[str, Any]]:
    from pivotspec.store import read_user_jsonl

    prompts = read_user_jsonl(path, "prompts file")
    for n, obj in enumerate(prompts, 1):
        if not ({"prompt", "messages"} & obj.keys()):
            raise UsageError(f'{path}: record {n} needs a "prompt" or "messages" key')
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise UsageError(f'{path}: record {n}: "prompt" must be a string')
    return prompts


def generation_json(gen: Any, tokenizer: Any) -> dict[str, Any]:
    return {
        "text": gen.text,
        "token_ids": gen.token_ids,
        "stats": gen.stats,
        "trace": [{"id": t, "text": tokenizer.decode([t]), "source": s} for t, s in gen.trace],
    }


def _policy_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"classifier": args.classifier, "sigma": args.sigma, "tau": args.tau}


def cmd_generate(args: argparse.Namespace) -> None:
    from pivotspec.policies import make_policy

    api.check_decoding(args.gamma, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.stop)
    method = args.method or ("sd" if (args.draft or args.pair) else "ar")
    prompts = read_prompts(args.prompts_file) if args.prompts_file else [{"prompt": args.prompt}]
    make_policy(method, None, pair=args.pair, **_policy_args(args))  # argument errors before models load
    pair = load_pair(args, needs_draft=method != "ar")
    policy = make_policy(method, pair.target, pair=args.pair, **_policy_args(args))
    for item in prompts:
        gen = api.generate(pair, item.get("prompt"), messages=item.get("messages"), method=method, policy=policy,
                           gamma=args.gamma, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat,
                           chat_template_kwargs=args.chat_template_kwargs)
        if args.json:
            print(json.dumps(generation_json(gen, pair.target.tokenizer)), flush=True)
        else:
            s = gen.stats
            print(gen.text, flush=True)
            tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
            eta = f"{s['eta']:.2f}" if s["eta"] is not None else "-"
            print(f"[{method}] {s['new_tokens']} tokens, {s['wall_s']:.2f}s, tau {tau}, eta {eta}", file=sys.stderr)


def task_name(args: argparse.Namespace) -> str:
    """--task, else the task the --pair was trained for, else arith."""
    if args.task:
        return args.task
    pair = PAIRS.get(args.pair) if args.pair else None
    return pair.task if pair is not None and pair.task else "arith"


def _eval_settings(args: argparse.Namespace) -> Any:
    from pivotspec.evaluation import EvalSettings

    args.task = task_name(args)
    return EvalSettings(task=args.task, data=args.data, split=args.split, n=args.n, seed=args.seed, gamma=args.gamma,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        max_new_tokens=args.max_new_tokens, chat=not args.no_chat,
                        chat_template_kwargs=args.chat_template_kwargs, stop=args.stop, classifier=args.classifier,
                        out=args.out, overwrite=args.overwrite)


def run_eval_command(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from pivotspec.evaluation import method_specs
    from pivotspec.policies import parse_floats
    from pivotspec.tasks import get_task

    settings = _eval_settings(args)
    api.check_decoding(args.gamma, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.stop)
    if args.n < 1:
        raise UsageError(f"--n must be >= 1, got {args.n}")
    get_task(args.task, args.data)  # task and data errors before the (slow) model loading
    sigmas = parse_floats(args.sigmas, "--sigmas") if args.sigmas else None
    baselines = [b for b in (args.baselines or "").split(",") if b] + list(args.baseline)
    kwargs = {"sigmas": sigmas, "baselines": baselines, "pair": args.pair, **_policy_args(args)}
    specs = method_specs(args.methods, None, **kwargs)
    if args.out is not None:
        ensure_writable_dir(args.out)
    pair = load_pair(args, needs_draft=any(s.method != "ar" for s in specs))
    specs = method_specs(args.methods, pair.target, **kwargs)
    return api.evaluate(pair, settings, specs=specs)


def cmd_eval(args: argparse.Namespace) -> None:
    from pivotspec.reports import format_table

    summary = run_eval_command(args)
    if args.json:
        print(json.dumps({"methods": summary}))
    else:
        print(format_table(summary))
        if args.out:
            print(f"report: {args.out / 'report.html'}")


DEMO_MARK = ".pivotspec-demo"


def cmd_demo(args: argparse.Namespace) -> None:
    """eval of an embedded pair on its task's test problems, with the shipped classifier when there is one."""
    from pivotspec.policies import default_classifier
    from pivotspec.reports import format_table

    out = args.out
    if out.exists() and not out.is_dir():
        ensure_writable_dir(out)  # the one-line error for a file in the way
    earlier_demo = (out / DEMO_MARK).is_file()
    if out.is_dir() and any(out.iterdir()) and not (earlier_demo or args.overwrite):
        raise UsageError(f"{out} holds files that are not an earlier demo: pass --overwrite to replace them, or "
                         "choose another --out")
    task = PAIRS[args.pair].task if args.pair in PAIRS else None
    if task is None:
        embedded = ", ".join(name for name, p in PAIRS.items() if p.task)
        raise UsageError(f"the demo runs an embedded pair ({embedded}), not {args.pair!r}: use pivotspec eval")
    clf_dir = default_classifier(args.pair)
    methods = "ar,sd,pad" if clf_dir else "ar,sd"
    ns = build_parser().parse_args(["eval", "--pair", args.pair, "--task", task, "--methods", methods,
                                    "--n", str(args.n), "--out", str(out), "--overwrite"]
                                   + (["--threads", str(args.threads)] if args.threads else [])
                                   + (["--device", args.device] if args.device else []))
    ns.chat_template_kwargs = args.chat_template_kwargs
    if not clf_dir:
        print("pivotspec: note: no pivot classifier is shipped yet, so the demo runs ar and sd only",
              file=sys.stderr)
    ensure_writable_dir(out)
    (out / DEMO_MARK).write_text("written by `pivotspec demo`; a later demo may replace this directory\n")
    summary = run_eval_command(ns)
    print(format_table(summary))
    print(f"report: {(out / 'report.html').resolve()}")


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        from pivotspec.server import Settings, serve
    except ImportError:
        raise UsageError("pivotspec serve needs FastAPI and uvicorn: pip install 'pivotspec[serve]'") from None
    if args.max_queue < 0 or args.gamma < 1 or args.max_tokens < 1:
        raise UsageError("--max-queue must be >= 0, --gamma and --max-tokens >= 1")
    pair = load_pair(args, needs_draft=args.method != "ar")
    settings = Settings(model=args.model_name or pair.target.name, method=args.method, classifier=args.classifier,
                        sigma=args.sigma, gamma=args.gamma, max_queue=args.max_queue, api_key=args.api_key,
                        max_tokens=args.max_tokens)
    from pivotspec.server.app import Server

    Server(pair, settings).policy(settings.method, settings.sigma)  # a bad default method fails now, not per request
    print(f"pivotspec: serving {settings.model!r} ({settings.method}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    serve(pair, settings, args.host, args.port)


def cmd_label(args: argparse.Namespace) -> None:
    from pivotspec.label_files import label_stats, parse_shard
    from pivotspec.labeling import LabelConfig
    from pivotspec.tasks import get_task

    config = dict(rollouts=args.rollouts, temperature=args.temperature, top_p=args.top_p,
                  max_rollout_tokens=args.max_rollout_tokens, mode=args.mode, alpha=args.alpha, follow=args.follow,
                  min_target_rate=args.min_target_rate, max_walk_tokens=args.max_walk_tokens, seed=args.seed,
                  engine=args.engine)
    LabelConfig(**config)  # argument errors before the (slow) model loading
    if args.n_problems < 1:
        raise UsageError(f"--n-problems must be >= 1, got {args.n_problems}")
    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {args.concurrency}")
    args.task = task_name(args)
    get_task(args.task)
    run = dict(task=args.task, split=args.split, n_problems=args.n_problems, overwrite=args.overwrite,
               judge=args.judge, chat_template_kwargs=args.chat_template_kwargs, concurrency=args.concurrency,
               **config)
    if args.ray:
        if args.shard:
            raise UsageError("--ray makes its own shards: drop --shard (or run one shard per machine without --ray)")
        merged = api.label_on_ray(args.out, target=args.target, draft=args.draft, pair=args.pair, dtype=args.dtype,
                                  device=args.device, threads=args.threads, workers=args.workers,
                                  address=args.ray_address, **run)
        print(f"{args.out}: {merged['candidates']} candidates, {merged['problems']} problems from "
              f"{args.workers} shards")
        return
    shard = parse_shard(args.shard) if args.shard else None
    pair = load_pair(args, needs_draft=True)
    records = api.label(pair, args.out, shard=shard, **run)
    s = label_stats(records)
    print(f"{args.out}: {s['candidates']} candidates, {s['pivots']} pivots, "
          f"{s['problems_done']} problems done, {s['problems_skipped']} skipped")


def cmd_labels_merge(args: argparse.Namespace) -> None:
    from pivotspec.label_files import merge_labels

    n = merge_labels(args.out, args.inputs, args.overwrite)
    print(f"{args.out}: {n['candidates']} candidates, {n['problems']} problems from {len(args.inputs)} files")


def cmd_labels_stats(args: argparse.Namespace) -> None:
    from pivotspec.label_files import label_stats
    from pivotspec.store import read_records

    if not args.file.is_file():
        raise UsageError(f"labels file {str(args.file)!r} does not exist: check the path")
    s = label_stats(read_records(args.file, repair=False))
    if args.pair or args.target:
        from pivotspec.classifier_training import probability_properties

        pair = api.load_pair(args.target, pair=args.pair, device=args.device)
        s["p_d"] = probability_properties(args.file, pair.target, args.classifier)
    elif args.classifier:
        raise UsageError("--classifier needs the target: pass --pair or --target")
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
    if "p_d" in s:
        p = s["p_d"]
        print(f"p(d) < {p['threshold']:g} among non-pivots: {p['harmless_low_p']:.3f} | p(d) > {p['threshold']:g} "
              f"among pivots: {p['pivots_high_p']:.3f}")
        line = f"report split ({p['report_candidates']} candidates) AUROC: p(d) only {p['report_auroc_p_d']:.3f}"
        if "report_auroc_classifier" in p:
            note = "" if p["classifier_trained_on_this_file"] else " (classifier trained on another file)"
            line += f", classifier {p['report_auroc_classifier']:.3f}{note}"
        print(line)


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
