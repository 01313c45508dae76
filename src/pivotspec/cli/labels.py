"""``pivotspec label`` and ``pivotspec labels stats|merge``: Monte-Carlo pivot labels and their files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pivotspec import api
from pivotspec.cli.common import SPLITS, TASK_NAMES, Parser, add_chat_args, add_model_args, load_pair, task_name


def add_parsers(sub: Any) -> None:
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
    lab.add_argument("--follow", choices=["label", "target", "policy"], default=None,
                     help="continue the walk with d when non-pivot (label, the default), always with t (target), or "
                     "with d where the rollout policy keeps it (policy, the default with --rollout-policy pad)")
    lab.add_argument("--rollout-policy", choices=["target", "pad"], default="target",
                     help="continue each rollout with the target alone (default, as the paper) or under PAD "
                     "(draft + target + classifier at --policy-sigma, batched): on-policy labels")
    lab.add_argument("--policy-classifier", help="the rollout policy's classifier (default: the pair's shipped one)")
    lab.add_argument("--policy-sigma", type=float, help="the rollout policy's sigma (default: its calibrated one)")
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
                     "sampled in one batch (torch engine: 1.19x the wall-clock rate at 4 on 2 CPU cores, see "
                     "README; 1 reproduces a run bit for bit whatever the sharding)")
    lab.add_argument("--ray", action="store_true", help="label --workers shards as Ray tasks and merge them into --out")
    lab.add_argument("--ray-address", help="an existing Ray cluster (e.g. ray://head:10001 or auto); default: a "
                     "local cluster started for the run")
    lab.add_argument("--workers", type=int, default=2, help="shards (Ray tasks) with --ray")
    add_chat_args(lab)
    lab.set_defaults(func=cmd_label)


    labels = sub.add_parser("labels", help="inspect a labels file")
    labels_sub = labels.add_subparsers(dest="labels_command", required=True, parser_class=Parser,
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


def cmd_label(args: argparse.Namespace) -> None:
    config = dict(rollouts=args.rollouts, temperature=args.temperature, top_p=args.top_p,
                  max_rollout_tokens=args.max_rollout_tokens, mode=args.mode, alpha=args.alpha, follow=args.follow,
                  min_target_rate=args.min_target_rate, max_walk_tokens=args.max_walk_tokens, seed=args.seed,
                  engine=args.engine, rollout_policy=args.rollout_policy, policy_classifier=args.policy_classifier,
                  policy_sigma=args.policy_sigma)
    made_in = None if args.overwrite or args.dtype else api.labels_dtype(args.out)
    if made_in:  # auto could pick another dtype here than where the file was made, and the resume would refuse
        args.dtype = made_in
        print(f"pivotspec: resuming {args.out} in {made_in}, the dtype it was made in (--dtype overrides)",
              file=sys.stderr)
    run = dict(task=task_name(args), split=args.split, n_problems=args.n_problems, overwrite=args.overwrite,
               judge=args.judge, chat_template_kwargs=args.chat_template_kwargs, concurrency=args.concurrency,
               **config)
    if args.ray:
        merged = api.label_on_ray(args.out, target=args.target, draft=args.draft, pair=args.pair, dtype=args.dtype,
                                  device=args.device, threads=args.threads, workers=args.workers,
                                  address=args.ray_address, shard=args.shard, **run)
        print(f"{args.out}: {merged['candidates']} candidates, {merged['problems']} problems from "
              f"{args.workers} shards")
        return
    shard = api.check_label(shard=args.shard, pair_name=args.pair, **run)  # argument errors before models load
    pair = load_pair(args, needs_draft=True)
    s = api.count_labels(api.label(pair, args.out, shard=shard, **run))
    print(f"{args.out}: {s['candidates']} candidates, {s['pivots']} pivots, "
          f"{s['problems_done']} problems done, {s['problems_skipped']} skipped")


def cmd_labels_merge(args: argparse.Namespace) -> None:
    n = api.merge_labels(args.out, args.inputs, args.overwrite)
    print(f"{args.out}: {n['candidates']} candidates, {n['problems']} problems from {len(args.inputs)} files")


def cmd_labels_stats(args: argparse.Namespace) -> None:
    s = api.labels_stats(args.file, pair=args.pair, target=args.target, classifier=args.classifier,
                         device=args.device)
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
