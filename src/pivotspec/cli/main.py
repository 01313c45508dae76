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

import pivotspec
from pivotspec import api
from pivotspec.cli.classifier import add_parsers as add_classifier_parsers
from pivotspec.cli.common import (
    SPLITS,
    TASK_NAMES,
    Parser,
    add_chat_args,
    add_decoding_args,
    add_model_args,
    load_pair,
    parse_floats,
    policy_args,
    task_name,
)
from pivotspec.cli.labels import add_parsers as add_labels_parsers
from pivotspec.errors import UsageError

ENGINE_HELP = ("torch: pivotspec's own loop; vllm: ar, sd and pad inside vLLM's engine (PAD by pivotspec's vLLM "
               "plugin; vLLM 0.32 in .venv-vllm from ./install.sh --with-vllm, or $PIVOTSPEC_VLLM_PYTHON)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pivotspec", description="Pivot-aware speculative decoding (PAD) on Hugging Face causal LMs.")
    parser.add_argument("--version", action="version", version=f"pivotspec {pivotspec.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")

    gen = sub.add_parser("generate", help="decode prompts with ar, draft, sd or pad")
    add_model_args(gen)
    add_decoding_args(gen)
    gen.add_argument("--method", choices=api.METHODS, help="default: sd with a draft, else ar")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", type=Path,
                     help='JSONL, one {"prompt": ...} or {"messages": [...]} per line; models load once')
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, stats, trace")
    gen.add_argument("--engine", choices=api.ENGINES, default="torch", help=ENGINE_HELP + "; all prompts decode as "
                     "one batch there, and stats are the batch's")
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
    ev.add_argument("--budgets", help="PAD per answer: one run per budget, e.g. 0.1,0.3 (see --budget); with "
                    "--sigmas one per (sigma, budget)")
    ev.add_argument("--baselines", help="relaxed rules at default knobs: typical,topk,threshold,ensemble,divergence")
    ev.add_argument("--baseline", action="append", default=[],
                    help="one relaxed rule with knobs, e.g. topk:k=3,ratio=0.2 (repeatable; default: none)")
    ev.add_argument("--no-chat", action="store_true", help="plain prompts instead of the chat template")
    ev.add_argument("--batch-size", type=int, default=1, help="rows decoded together (same outputs when greedy; "
                    "> 1 reports throughput instead of per-problem speedups)")
    ev.add_argument("--out", type=Path, help="write results.jsonl, summary.json/md, pareto.png, report.html here; "
                    "rerunning the same command resumes")
    ev.add_argument("--overwrite", action="store_true", help="start --out over instead of resuming")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--engine", choices=api.ENGINES, default="torch", help=ENGINE_HELP)
    ev.set_defaults(func=cmd_eval)

    add_labels_parsers(sub)  # label, labels stats|merge

    demo = sub.add_parser("demo", help="the embedded testbed: ar, sd and pad side by side with a report",
                          description="Decode test problems of an embedded pair's task (testbed: arith, "
                          "testbed-hard: arith-hard) with ar, sd and pad (the shipped classifier) and write a "
                          "report to --out. An --out that holds "
                          "anything but an earlier demo is refused unless --overwrite; an earlier demo there is "
                          "replaced.")
    demo.add_argument("--pair", default="testbed", help="an embedded pair: testbed (task arith) or testbed-hard "
                      "(task arith-hard)")
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
    srv.add_argument("--max-batch", type=int, default=8, help="requests decoding together (continuous batching); "
                     "1 decodes one at a time")
    srv.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                     help="compute every prompt whole, even where a start of it is already in the batch's cache "
                          "(prefix caching is on by default where it keeps outputs bit for bit; to compare)")
    srv.add_argument("--max-queue", type=int, default=16, help="requests waiting for a free batch row before 429")
    srv.add_argument("--max-model-len", type=int, default=None, help="prompt + max_tokens above this is refused "
                     "with 400 (default: the target's positions)")
    srv.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request sets none")
    srv.add_argument("--api-key", help="require Authorization: Bearer KEY on every endpoint but /health")
    srv.add_argument("--model-name", help="the model id clients send (default: the target's name)")
    srv.add_argument("--engine", choices=api.ENGINES, default="torch", help=ENGINE_HELP + ". With vllm this runs "
                     "vLLM's own OpenAI server (its flags after --), requests set PAD's knobs in vllm_xargs "
                     "(pad_sigma, pad_p_floor), and /metrics adds pivotspec:pad_overrides_total")
    srv.add_argument("vllm_args", nargs="*", help="with --engine vllm: more flags for vLLM's server, after --")
    srv.set_defaults(func=cmd_serve)

    add_classifier_parsers(sub)

    return parser


def generation_json(gen: Any, tokenizer: Any) -> dict[str, Any]:
    return {
        "text": gen.text,
        "token_ids": gen.token_ids,
        "stats": gen.stats,
        "trace": [{"id": t, "text": tokenizer.decode([t]), "source": s} for t, s in gen.trace],
    }


def cmd_generate(args: argparse.Namespace) -> None:
    api.check_decoding(args.gamma, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.stop)
    method = args.method or ("sd" if (args.draft or args.pair) else "ar")
    prompts = api.read_prompts(args.prompts_file) if args.prompts_file else [{"prompt": args.prompt}]
    api.make_policy(None, method, pair_name=args.pair, **policy_args(args))  # argument errors before models load
    api.check_engine(args.engine, method, args.classifier)
    pair = load_pair(args, needs_draft=method != "ar")
    if args.engine == "vllm":
        return generate_in_vllm(args, pair, method, prompts)
    policy = api.make_policy(pair, method, **policy_args(args))
    for i, item in enumerate(prompts):
        # a prompts file's prompts draw their own numbers, as generate_many's rows do
        seed = api.derive_seed(args.seed, i) if args.prompts_file else args.seed
        gen = api.generate(pair, item.get("prompt"), messages=item.get("messages"), method=method, policy=policy,
                           gamma=args.gamma, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=seed, stop=args.stop, chat=args.chat,
                           chat_template_kwargs=args.chat_template_kwargs)
        if args.json:
            print(json.dumps(generation_json(gen, pair.target.tokenizer)), flush=True)
        else:
            s = gen.stats
            print(gen.text, flush=True)
            tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
            eta = f"{s['eta']:.2f}" if s["eta"] is not None else "-"
            print(f"[{method}] {s['new_tokens']} tokens, {s['wall_s']:.2f}s, tau {tau}, eta {eta}", file=sys.stderr)


def generate_in_vllm(args: argparse.Namespace, pair: api.Pair, method: str, prompts: list[dict[str, Any]]) -> None:
    """``generate --engine vllm``: every prompt in one vLLM batch."""
    if args.stop or args.budget is not None:
        raise UsageError("the vLLM engine takes neither --stop nor --budget: use --engine torch")
    ids = [api.encode(pair.target, item.get("prompt"), item.get("messages"), chat=args.chat,
                      chat_template_kwargs=args.chat_template_kwargs) for item in prompts]
    gens = api.vllm_generate(pair, ids, method, classifier=args.classifier, sigma=args.sigma, p_floor=args.p_floor,
                             gamma=args.gamma, seed=args.seed, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    for gen in gens:
        if args.json:
            print(json.dumps(generation_json(gen, pair.target.tokenizer)), flush=True)
        else:
            print(gen.text, flush=True)
    s = gens[0].stats if gens else None
    if s and not args.json:
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        eta = f"{s['eta']:.2f}" if s["eta"] is not None else "-"
        print(f"[{method} in vllm] {len(gens)} prompts, {sum(g.stats['new_tokens'] for g in gens)} tokens, "
              f"{s['wall_s']:.2f}s, tau {tau}, eta {eta}, overrides {s['override']}", file=sys.stderr)


def _eval_settings(args: argparse.Namespace) -> api.EvalSettings:
    return api.EvalSettings(task=task_name(args), data=args.data, split=args.split, n=args.n, seed=args.seed,
                            gamma=args.gamma, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, chat=not args.no_chat,
                            chat_template_kwargs=args.chat_template_kwargs, stop=args.stop,
                            classifier=args.classifier, out=args.out, overwrite=args.overwrite,
                            batch_size=args.batch_size, engine=getattr(args, "engine", "torch"))


def run_eval_command(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    settings = _eval_settings(args)
    sigmas = parse_floats(args.sigmas, "--sigmas") if args.sigmas else None
    baselines = [b for b in (args.baselines or "").split(",") if b] + list(args.baseline)
    budgets = parse_floats(args.budgets, "--budgets") if args.budgets else None
    kwargs = {"sigmas": sigmas, "budgets": budgets, "baselines": baselines, **policy_args(args)}
    specs = api.method_specs(None, args.methods, pair_name=args.pair, **kwargs)
    api.check_evaluate(settings)  # settings, task, data and --out before the (slow) model loading
    pair = load_pair(args, needs_draft=any(s.method != "ar" for s in specs))
    return api.evaluate(pair, settings, specs=api.method_specs(pair, args.methods, **kwargs))


def cmd_eval(args: argparse.Namespace) -> None:
    summary = run_eval_command(args)
    if args.json:
        print(json.dumps({"methods": summary}))
    else:
        print(api.format_table(summary))
        if args.out:
            print(f"report: {args.out / 'report.html'}")


DEMO_MARK = ".pivotspec-demo"


def cmd_demo(args: argparse.Namespace) -> None:
    """eval of an embedded pair on its task's test problems, with the shipped classifier when there is one."""
    task = api.pair_task(args.pair)
    if task is None:
        embedded = ", ".join(name for name in api.pair_names() if api.pair_task(name))
        raise UsageError(f"the demo runs an embedded pair ({embedded}), not {args.pair!r}: use pivotspec eval")
    clf_dir = api.default_classifier(args.pair)
    methods = "ar,sd,pad" if clf_dir else "ar,sd"
    out = args.out
    ns = build_parser().parse_args(["eval", "--pair", args.pair, "--task", task, "--methods", methods,
                                    "--n", str(args.n), "--out", str(out), "--overwrite"]
                                   + (["--threads", str(args.threads)] if args.threads else [])
                                   + (["--device", args.device] if args.device else []))
    ns.chat_template_kwargs = args.chat_template_kwargs
    earlier_demo = (out / DEMO_MARK).is_file()
    if out.is_dir() and any(out.iterdir()) and not (earlier_demo or args.overwrite):
        raise UsageError(f"{out} holds files that are not an earlier demo: pass --overwrite to replace them, or "
                         "choose another --out")
    api.check_evaluate(_eval_settings(ns))  # also a file in the way of --out, or one that cannot be written
    if not clf_dir:
        print("pivotspec: note: no pivot classifier is shipped yet, so the demo runs ar and sd only",
              file=sys.stderr)
    (out / DEMO_MARK).write_text("written by `pivotspec demo`; a later demo may replace this directory\n")
    summary = run_eval_command(ns)
    print(api.format_table(summary))
    print(f"report: {(out / 'report.html').resolve()}")


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        from pivotspec.server import Settings, serve
    except ImportError:
        raise UsageError("pivotspec serve needs FastAPI and uvicorn: pip install 'pivotspec[serve]'") from None
    if args.max_queue < 0 or args.gamma < 1 or args.max_tokens < 1 or args.max_batch < 1:
        raise UsageError("--max-queue must be >= 0, --gamma, --max-tokens and --max-batch >= 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError("--max-model-len must be >= 2 (a prompt token and a new one)")
    # a bad default method, classifier or sigma fails now, before the models load, not on every request
    api.make_policy(None, args.method, classifier=args.classifier, sigma=args.sigma, pair_name=args.pair)
    if args.engine == "vllm":
        return serve_in_vllm(args)
    if args.vllm_args:
        raise UsageError(f"unexpected arguments {' '.join(args.vllm_args)}: flags after -- go to vLLM's server, with "
                         "--engine vllm")
    # every server chooses its CPU kernels for a full batch, so that --max-batch never changes a response
    pair = load_pair(args, needs_draft=args.method != "ar", serving=True)
    settings = Settings(model=args.model_name or pair.target.name, method=args.method, classifier=args.classifier,
                        sigma=args.sigma, gamma=args.gamma, max_queue=args.max_queue, api_key=args.api_key,
                        max_tokens=args.max_tokens, max_batch=args.max_batch, max_model_len=args.max_model_len,
                        prefix_caching=args.prefix_caching)
    print(f"pivotspec: serving {settings.model!r} ({settings.method}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    serve(pair, settings, args.host, args.port)


def serve_in_vllm(args: argparse.Namespace) -> None:
    """``serve --engine vllm``: vLLM's own OpenAI server in this process's place (signals go straight to it)."""
    target, draft = api.resolve_names(args.target, args.draft, args.pair, needs_draft=args.method != "ar")
    cmd, env = api.vllm_server(target, draft, method=args.method, classifier=args.classifier, sigma=args.sigma,
                               gamma=args.gamma, host=args.host, port=args.port,
                               served_name=args.model_name or target, extra_args=args.vllm_args, pair_name=args.pair)
    print(f"pivotspec: serving {args.model_name or target!r} ({args.method} in vLLM) on "
          f"http://{args.host}:{args.port}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, {**os.environ, **env})


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
