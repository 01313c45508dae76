"""What every ``pivotspec`` subcommand's parser shares: the parser class with one-line errors, the model,
decoding and chat-template flags, and turning those flags into API calls (models, a task, a policy)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from pivotspec import api
from pivotspec.errors import UsageError

SPLITS = "train, validation or test (arith, arith-hard); test (humaneval, gsm8k, mbpp, jsonl: the file's rows)"
TASK_NAMES = "arith, arith-hard, humaneval, gsm8k, mbpp or jsonl (default: the --pair's task, else arith)"


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default (flags whose default is None or False show none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a typo must not silently match a longer flag
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, not usage + message
        raise UsageError(f"{self.prog}: {message} (see --help)")


class OldFlag(argparse.Action):
    """A renamed flag that still works: stores into the new flag's place and says the new name once."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"pivotspec: note: {option_string} is now {self.new} (the old flag still works)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def parse_floats(text: str, what: str) -> list[float]:
    """'0.3,0.5' -> [0.3, 0.5]; anything else is a one-line error naming the flag."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise UsageError(f"{what} must be comma-separated finite numbers, got {text!r}")
    return values


def json_object(text: str) -> dict[str, Any]:
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
    g.add_argument("--pair", choices=api.pair_names(), help="shorthand for a registered target/draft pair (its task is "
                   "then the default --task)")
    g.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N or mps (default: $PIVOTSPEC_DEVICE, else "
                   "auto: CUDA if available, else CPU)")
    g.add_argument("--dtype", default=None, help="auto, float32, bfloat16, float16 or int8 (default: "
                   "$PIVOTSPEC_DTYPE, else bfloat16 on CUDA and auto elsewhere: on a CPU, the fastest of float32 with "
                   "plain, oneDNN-packed or row-wise linears and, where the CPU has bfloat16 instructions, bfloat16 on "
                   "the row-wise kernel or packed, measured once per machine and model; bfloat16 alone: the row-wise "
                   "kernel where it builds (other activations float32); int8, CPU only and never chosen by auto: "
                   "weight-only int8 linears, other tokens than the checkpoint's)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help='extra variables for the chat template, e.g. \'{"enable_thinking": false}\' for Qwen3')


def add_decoding_args(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--gamma", type=int, default=5, help="draft tokens per step")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="most new tokens per completion")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (and problem order for eval); eval seeds each "
                   "problem with derive_seed(seed, problem id), a --prompts-file prompt i with derive_seed(seed, i)")
    g.add_argument("--classifier", help="pivot classifier for --method pad: a directory from train-classifier, "
                   "or const:SCORE (a constant score, for ablations); with an embedded --pair its shipped one")
    g.add_argument("--sigma", type=float, default=None,
                   help="PAD: override when pivot score <= sigma (0 = SD; default: the classifier's calibrated sigma, "
                   "0.5 for const:)")
    g.add_argument("--budget", type=float, default=None,
                   help="PAD per answer: keep overrides while the answer's summed predicted utility drop (the "
                   "classifier's drop head) stays <= this (0 = SD); with --sigma each override must pass that too")
    g.add_argument("--p-floor", type=float, default=api.DEFAULT_P_FLOOR,
                   help="PAD: an override needs the target's probability of the token >= this (the paper's tau; eval "
                   "labels a non-default floor as pad@0.1 tau=0.01)")
    g.add_argument("--tau", type=float, dest="p_floor", action=OldFlag, new="--p-floor",
                   help="the old name of --p-floor, still accepted")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    add_chat_args(p)


def load_pair(args: argparse.Namespace, needs_draft: bool, serving: bool = False) -> api.Pair:
    return api.load_pair(args.target, args.draft, pair=args.pair, dtype=args.dtype, threads=args.threads,
                         device=args.device, needs_draft=needs_draft, serving=serving)


def task_name(args: argparse.Namespace) -> str:
    """--task, else the task the --pair was trained for, else arith."""
    return api.task_for(args.task, args.pair)


def policy_args(args: argparse.Namespace) -> dict[str, Any]:
    """The PAD flags as the API's keywords."""
    return {"classifier": args.classifier, "sigma": args.sigma, "budget": args.budget, "p_floor": args.p_floor}
