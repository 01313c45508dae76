"""What one kept override costs a whole answer, measured by randomizing PAD's decisions (issue 30).

    python benchmarks/override_harm.py run --pair testbed-hard --n 150 --repeats 8
    python benchmarks/override_harm.py analyze

The Monte-Carlo labels price one kept draft token followed by rollouts; a PAD answer keeps many, and on
`testbed-hard` the accuracy PAD loses is the target's own arithmetic going wrong in the context its kept
wordings build. This study measures that cost where it arises, in whole answers: every position where PAD
(the pair's classifier at ``--sigma``, 0.5 by default, a superset of every sigma the tables use) would
override SD, a coin of the answer's own keeps the override with probability ``--q``, else the answer goes on as
SD would. Each problem is decoded ``--repeats`` times with other coins (greedy otherwise), on validation
problems of a seed no label and no selection used (``--seed 2``).

Because each coin is independent of everything before it, the effect of keeping decision i on the answer's
success is estimated without a model: E[(k_i - q) (y - b)] = q (1 - q) * effect_i, where b is the mean success
of the problem's other repeats (independent of the coin, so it only lowers the variance). ``analyze``
averages that over decisions by class (the classifier's score, the target's probability of the draft token,
what kind of token the draft and the target wrote, how many overrides the answer already kept), with 95%
intervals from resampling problems, and prints the per-class effects with the share of decisions in each
class (also on the overrides kept later and on the answer's length): a class whose kept overrides cost clearly
more than the rest is what a rule could leave out; equal costs everywhere mean the harm comes from how many
overrides an answer keeps, not from which. Beside it, a model: success regressed within problem on the
overrides each answer kept per score band. ``--seeds`` analyzes one run's problems (a hypothesis run and a
test run); ``--name`` names the JSON it writes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from pivotspec import api

OUT = Path("benchmarks/results/override_harm")


class RandomKeep:
    """PAD's overrides, each kept with probability ``q`` by the answer's own coin; logs each decision that
    matters (one the emitted prefix reaches: a draft after a rejected one is never emitted)."""

    def __init__(self, pad: Any, q: float, seed: str, tokenizer: Any):
        self.pad, self.q, self.rng, self.tok = pad, q, random.Random(seed), tokenizer
        self.hidden_layer, self.name = pad.hidden_layer, "pad-random"
        self.decisions: list[dict[str, Any]] = []

    def override(self, v: Any) -> Any:
        g = v.draft_tokens.shape[0]
        keep = v.sd_ok.clone().zero_()
        scores = self.pad.scores(v).tolist()
        p_d = v.draft_prob(v.p).tolist()
        q_d = v.draft_prob(v.q).tolist()
        top = v.p[:g].max(dim=-1)
        ctx = v.context
        kept = 0
        for i, ok in enumerate(v.sd_ok.tolist()):
            if ok:
                continue
            if scores[i] > self.pad.sigma or p_d[i] < self.pad.p_floor:
                break  # PAD rejects it as well: SD's correction follows
            k = self.rng.random() < self.q
            d, t = int(v.draft_tokens[i]), int(top.indices[i])
            # p_d / q_d: the target's / the draft's probability of d; p_t: the target's of its own token t
            self.decisions.append({"kept": k, "score": scores[i], "p_d": p_d[i], "q_d": q_d[i],
                                   "p_t": float(top.values[i]), "d": self.tok.decode([d]), "t": self.tok.decode([t]),
                                   "pos": ctx.generated + i, "before": ctx.overrides + kept})
            if not k:
                break
            keep[i] = True
            kept += 1
        return keep


def decode_chunk(pair: api.Pair, task: Any, problems: list[Any], args: argparse.Namespace) -> list[dict]:
    """ar once and ``repeats`` randomized answers per problem, as one batch."""
    pad = api.make_policy(pair, "pad", classifier=args.classifier, sigma=args.sigma)
    requests, meta = [], []
    for p in problems:
        for r in range(-1, args.repeats):
            policy = None if r < 0 else RandomKeep(pad, args.q, f"{p.id}/{r}", pair.target.tokenizer)
            requests.append(api.make_request(pair, p.prompt, messages=p.messages or None,
                                             method="ar" if r < 0 else "pad", policy=policy,
                                             max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                                             stop=list(getattr(task, "stop_strings", []))))
            meta.append((p, r, policy))
    gens = api.new_batch(pair).decode(requests, max_batch=args.batch_size)
    rows = []
    for (p, r, policy), gen in zip(meta, gens, strict=True):
        rows.append({"problem": p.id, "repeat": r, "method": "ar" if r < 0 else "random",
                     "score": task.score(p, gen.text), "tokens": len(gen.token_ids),
                     "overrides": sum(s == "override" for _, s in gen.trace),
                     "decisions": policy.decisions if policy else []})
    return rows


def answers_file(out: Path) -> Path:
    """OUT/answers.jsonl, restored from the compressed copy the repository keeps (answers.jsonl.gz) if need be."""
    path, packed = out / "answers.jsonl", out / "answers.jsonl.gz"
    if not path.exists() and packed.exists():
        path.write_bytes(gzip.decompress(packed.read_bytes()))
    return path


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    path = answers_file(args.out)
    done = {json.loads(line)["problem"] for line in path.open()} if path.exists() else set()
    pair = api.load_pair(pair=args.pair, threads=args.threads, dtype=args.dtype, needs_draft=True)
    task = api.get_task(api.task_for(None, args.pair))
    problems = [p for p in task.problems(args.split, args.n, args.seed) if p.id not in done]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    runs = json.loads((args.out / "run.json").read_text())["runs"] if (args.out / "run.json").exists() else []
    if any(r["q"] != args.q or r["sigma"] != args.sigma for r in runs):
        raise SystemExit(f"{args.out} holds answers at another --q or --sigma: pass a fresh --out")
    (args.out / "run.json").write_text(json.dumps({"runs": runs + [settings]}, indent=1))
    for start in range(0, len(problems), args.chunk):
        rows = decode_chunk(pair, task, problems[start:start + args.chunk], args)
        with path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{len(done) + start + len(problems[start:start + args.chunk])} problems", flush=True)


def kind(text: str) -> str:
    s = text.strip()
    if any(c.isdigit() for c in s):
        return "number"
    return "word" if any(c.isalpha() for c in s) else "space/punct"


def bins(value: float, edges: list[float], names: list[str]) -> str:
    return next((n for e, n in zip(edges, names, strict=False) if value <= e), names[-1])


CLASSES = {
    "all": lambda d: "all",
    "classifier score": lambda d: bins(d["score"], [0.05, 0.1, 0.2], ["<=0.05", "0.05-0.1", "0.1-0.2", "0.2-0.5"]),
    "target p(d)": lambda d: bins(d["p_d"], [0.01, 0.1, 0.3], ["<=0.01", "0.01-0.1", "0.1-0.3", ">0.3"]),
    "draft token": lambda d: kind(d["d"]),
    "target's token": lambda d: kind(d["t"]),
    "overrides kept before": lambda d: bins(d["before"], [1, 3, 6], ["0-1", "2-3", "4-6", "7+"]),
    "answer token": lambda d: bins(d["pos"], [15, 35, 60], ["0-15", "16-35", "36-60", "61+"]),
    # sigma 0.2's overrides (the floor aside) against the rest, by how many the answer already kept
    "kept before, by band": lambda d: (("score <= 0.2" if d["score"] <= 0.2 and d["p_d"] > 0.01 else "the rest")
                                       + " x " + bins(d["before"], [3, 6], ["0-3", "4-6", "7+"])),
}


# what keeping a decision changes: the answer's success, the overrides it keeps after that decision (does a kept
# draft wording draw more?) and its length; each with a baseline from the problem's other answers
OUTCOMES = {
    "success": (lambda a, i: a["score"], lambda o: o["score"]),
    "later overrides": (lambda a, i: sum(d["kept"] for d in a["decisions"][i + 1:]),
                        lambda o: sum(d["kept"] for d in o["decisions"]) / 2),
    "answer tokens": (lambda a, i: a["tokens"], lambda o: o["tokens"]),
}


def effects(rows: list[dict], q: float, outcome: str = "success", draws: int = 1000,
            seed: int = 0) -> dict[str, dict[str, dict]]:
    """Per class: decisions and the effect of keeping one on ``outcome``, with a problem-bootstrap 95% CI."""
    value, baseline = OUTCOMES[outcome]
    by_problem: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["method"] == "random":
            by_problem[row["problem"]].append(row)
    # per problem and class: the sum over decisions of (k - q)(y - b), and the count of decisions
    terms: dict[str, dict[tuple[str, str], list[float]]] = {}
    for pid, answers in by_problem.items():
        acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        for a in answers:
            others = [baseline(o) for o in answers if o is not a]
            base = statistics.fmean(others) if others else 0.0
            for i, d in enumerate(a["decisions"]):
                y = value(a, i)
                for family, of in CLASSES.items():
                    cell = acc[(family, of(d))]
                    cell[0] += (float(d["kept"]) - q) * (y - base)
                    cell[1] += 1
        terms[pid] = acc
    pids = sorted(terms)
    cells = sorted({c for acc in terms.values() for c in acc})

    def estimate(sample: list[str]) -> dict[tuple[str, str], float]:
        out = {}
        for c in cells:
            num = sum(terms[p][c][0] for p in sample if c in terms[p])
            n = sum(terms[p][c][1] for p in sample if c in terms[p])
            out[c] = num / (q * (1 - q) * n) if n else float("nan")
        return out

    point = estimate(pids)
    rng = random.Random(seed)
    boot = [estimate([rng.choice(pids) for _ in pids]) for _ in range(draws)]
    result: dict[str, dict[str, dict]] = defaultdict(dict)
    for c in cells:
        vals = sorted(b[c] for b in boot if b[c] == b[c])
        n = sum(terms[p][c][1] for p in pids if c in terms[p])
        result[c[0]][c[1]] = {"decisions": int(n), "effect": point[c],
                              "ci": [vals[int(0.025 * len(vals))], vals[int(0.975 * len(vals)) - 1]]}
    return dict(result)


BANDS = ("score <= 0.1", "score 0.1-0.2", "score 0.2-0.5", "target p(d) <= 0.01")


def band(d: dict) -> int:
    """The regression's class of a decision: the classifier's score band, or a draft the target all but rules out."""
    if d["p_d"] <= 0.01:
        return 3
    return 0 if d["score"] <= 0.1 else 1 if d["score"] <= 0.2 else 2


def regression(rows: list[dict], draws: int = 500, seed: int = 0) -> dict[str, dict]:
    """Success on the overrides an answer kept per band, within problem (each problem's mean removed), least
    squares with a problem-bootstrap 95% CI: the points one more kept override of a band costs, all kept
    overrides of the answer counted together (the randomization makes the kept counts independent of the
    problem)."""
    by_problem: dict[str, list[tuple[list[float], float]]] = defaultdict(list)
    for r in rows:
        if r["method"] == "random":
            x = [0.0] * len(BANDS)
            for d in r["decisions"]:
                x[band(d)] += d["kept"]
            by_problem[r["problem"]].append((x, r["score"]))

    def fit(sample: list[str]) -> list[float]:
        xs, ys = [], []
        for pid in sample:
            answers = by_problem[pid]
            mx = np.mean([x for x, _ in answers], axis=0)
            my = statistics.fmean(y for _, y in answers)
            xs += [np.asarray(x) - mx for x, _ in answers]
            ys += [y - my for _, y in answers]
        return np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)[0].tolist()

    pids = sorted(by_problem)
    point = fit(pids)
    rng = random.Random(seed)
    boot = np.array([fit([rng.choice(pids) for _ in pids]) for _ in range(draws)])
    kept = np.mean([x for answers in by_problem.values() for x, _ in answers], axis=0)
    return {name: {"effect": point[i], "ci": np.percentile(boot[:, i], [2.5, 97.5]).tolist(),
                   "kept_per_answer": float(kept[i])} for i, name in enumerate(BANDS)}


def analyze(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in answers_file(args.out).open()]
    if args.seeds:  # problem ids end in -SEED-INDEX
        rows = [r for r in rows if r["problem"].split("-")[-2] in args.seeds.split(",")]
    q = json.loads((args.out / "run.json").read_text())["runs"][0]["q"]
    random_rows = [r for r in rows if r["method"] == "random"]
    ar_rows = [r for r in rows if r["method"] == "ar"]
    kept = [sum(d["kept"] for d in r["decisions"]) for r in random_rows]
    summary = {"problems": len(ar_rows), "answers": len(random_rows),
               "ar_accuracy": statistics.fmean(r["score"] for r in ar_rows),
               "random_accuracy": statistics.fmean(r["score"] for r in random_rows),
               "kept_per_answer": statistics.fmean(kept),
               "decisions_per_answer": statistics.fmean(len(r["decisions"]) for r in random_rows),
               "effects": {o: effects(rows, q, o) for o in OUTCOMES}}
    summary["regression"] = regression(rows)
    print(f"{summary['problems']} problems, {summary['answers']} randomized answers (q {q}): accuracy "
          f"{summary['random_accuracy']:.3f} (ar {summary['ar_accuracy']:.3f}), {summary['kept_per_answer']:.1f} "
          f"overrides kept of {summary['decisions_per_answer']:.1f} decisions per answer\n")
    print("| class | value | decisions | share | effect of keeping one on success [95% CI] | on later overrides kept "
          "| on answer tokens |")
    print("|---|---|---|---|---|---|---|")
    eff = summary["effects"]
    total = eff["success"]["all"]["all"]["decisions"]

    def cell(e: dict, digits: int) -> str:
        return f"{e['effect']:+.{digits}f} [{e['ci'][0]:+.{digits}f}, {e['ci'][1]:+.{digits}f}]"

    for family, values in eff["success"].items():
        for value, e in values.items():
            later, tokens = eff["later overrides"][family][value], eff["answer tokens"][family][value]
            print(f"| {family} | {value} | {e['decisions']} | {e['decisions'] / total:.0%} | {cell(e, 3)} | "
                  f"{cell(later, 2)} | {cell(tokens, 1)} |")
    print("\n| kept override of band | per answer | success per override kept (within problem) [95% CI] |")
    print("|---|---|---|")
    for name, e in summary["regression"].items():
        print(f"| {name} | {e['kept_per_answer']:.2f} | {cell(e, 3)} |")
    if args.tokens:
        summary["tokens"] = token_effects(random_rows, q, args.tokens)
        print(f"\n| the {args.tokens} most frequent (draft token, target token) | decisions "
              "| effect on success [95% CI] |")
        print("|---|---|---|")
        for pair, e in summary["tokens"].items():
            print(f"| {pair} | {e['decisions']} | {cell(e, 3)} |")
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=1))


def token_effects(rows: list[dict], q: float, top: int) -> dict[str, dict]:
    """The effect on success of keeping the ``top`` most frequent (draft token, target token) decisions."""
    counts = defaultdict(int)
    for r in rows:
        for d in r["decisions"]:
            counts[(d["d"], d["t"])] += 1
    frequent = sorted(counts, key=counts.get, reverse=True)[:top]
    CLASSES["tokens"] = lambda d: repr((d["d"], d["t"])) if (d["d"], d["t"]) in frequent else "other"
    try:
        found = effects(rows, q)["tokens"]
    finally:
        del CLASSES["tokens"]
    return {repr(pair): found[repr(pair)] for pair in frequent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(required=True)
    r = sub.add_parser("run", help="decode the randomized answers (resumes by problem)")
    r.add_argument("--pair", default="testbed-hard")
    r.add_argument("--split", default="validation")
    r.add_argument("--seed", type=int, default=2, help="problem seed: 2 is used by no label file and no selection")
    r.add_argument("--n", type=int, default=150)
    r.add_argument("--repeats", type=int, default=8)
    r.add_argument("--q", type=float, default=0.5, help="probability of keeping each override PAD would make")
    r.add_argument("--classifier", default=None, help="default: the pair's shipped classifier")
    r.add_argument("--sigma", type=float, default=0.5)
    r.add_argument("--gamma", type=int, default=5)
    r.add_argument("--max-new-tokens", type=int, default=200)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--chunk", type=int, default=12, help="problems per batch call (written after each)")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--dtype", default="float32")
    r.set_defaults(func=run)
    a = sub.add_parser("analyze", help="estimate the effects from the answers")
    a.add_argument("--seeds", default="", help="only the problems of these seeds (comma list; default: all)")
    a.add_argument("--name", default="summary", help="the JSON written: OUT/NAME.json")
    a.add_argument("--tokens", type=int, default=0, help="also the effect of the N most frequent (draft token, "
                   "target token) decisions")
    a.set_defaults(func=analyze)
    for p in (r, a):
        p.add_argument("--out", type=Path, default=OUT, help=f"answers.jsonl, run.json and the tables (default: {OUT})")
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
