"""Pivot labels by Monte-Carlo rollouts of the target (the PAD paper, arXiv 2511.00351).

Walk a greedy trajectory with target and draft side by side; where they disagree (draft token d, target
token t) SD would reject d, so it is a *candidate*. Sample N target continuations after d and N after t,
all 2N as one batch from a copy of the shared prefix cache, score them with the task, and label d a pivot
when its success rate U_acc falls short of U_rej's by the chosen rule. The walk then continues with d when
it is harmless (else t), so later candidates sit on trajectories PAD would actually produce.

On-policy labels (``rollout_policy="pad"``): the rollouts continue under a PAD policy (draft proposes, target
verifies, the classifier overrides; ``rollouts.PolicyEngine``) instead of the target alone, and the walk
follows that policy's own greedy decisions (d where PAD keeps it, else t), so a label prices a kept token
together with the overrides the policy goes on to make after it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pivotspec.decoding.models import LM, eos_ids
from pivotspec.decoding.sampling import SamplingConfig, argmax, derive_seed
from pivotspec.errors import UsageError
from pivotspec.labels.identity import identity_diff, model_identity
from pivotspec.labels.rollouts import ENGINES, PolicyEngine, RolloutEngine, RolloutRequest, make_engine
from pivotspec.store import append_record, open_for_append, read_records
from pivotspec.tasks import Problem, Task, encode_problem, encode_prompt

MODES = ("mul", "add", "abs")
FOLLOW = ("label", "target", "policy")
ROLLOUT_POLICIES = ("target", "pad")


@dataclass(frozen=True)
class LabelConfig:
    rollouts: int = 20  # N per side (authors' default)
    temperature: float = 0.7
    top_p: float = 1.0
    max_rollout_tokens: int = 160
    mode: str = "mul"
    alpha: float = 0.5
    follow: str = "label"  # "label": d when non-pivot; "target": always t; "policy": d when the policy keeps it
    min_target_rate: float = 0.3  # screening: skip problems the target solves at <= this rate (< 0 disables)
    max_walk_tokens: int = 200
    seed: int = 0
    engine: str = "torch"  # who samples the rollouts (rollouts.ENGINES); the walk always runs on torch
    rollout_policy: str = "target"  # "target": rollouts by the target alone; "pad": under the policy below
    policy: str | None = None  # with "pad": what identifies it (classifier files' fingerprint, sigma, floor, gamma)

    def __post_init__(self) -> None:
        if self.rollouts < 1:
            raise UsageError(f"--rollouts must be >= 1, got {self.rollouts}")
        if self.mode not in MODES:
            raise UsageError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 < self.alpha <= 1:
            raise UsageError(f"--alpha must be in (0, 1], got {self.alpha}")
        if self.follow not in FOLLOW:
            raise UsageError(f"--follow must be one of {', '.join(FOLLOW)}, got {self.follow!r}")
        if self.rollout_policy not in ROLLOUT_POLICIES:
            raise UsageError(f"--rollout-policy must be one of {', '.join(ROLLOUT_POLICIES)}, "
                             f"got {self.rollout_policy!r}")
        if (self.rollout_policy == "pad") != (self.follow == "policy") or (self.rollout_policy == "pad") != bool(
                self.policy):
            raise UsageError("--rollout-policy pad walks the policy's own trajectory (--follow policy) and needs "
                             "the policy; --follow policy needs --rollout-policy pad")
        if self.rollout_policy == "pad" and self.engine != "torch":
            raise UsageError("rollouts under a policy run on the torch engine: drop --engine vllm")
        if self.max_rollout_tokens < 1 or self.max_walk_tokens < 1:
            raise UsageError("--max-rollout-tokens and --max-walk-tokens must be >= 1")
        if self.engine not in ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        SamplingConfig(self.temperature, 0, self.top_p)  # validates temperature and top-p

    def as_dict(self) -> dict:
        """The config as stored with every label; the default engine is left out, so files labeled before
        engines existed still resume and merge with torch-labeled ones."""
        d = asdict(self)
        if d["engine"] == "torch":
            del d["engine"]
        if d["rollout_policy"] == "target":  # likewise files labeled before rollout policies existed
            del d["rollout_policy"], d["policy"]
        return d


def is_pivot(u_acc: float, u_rej: float, mode: str, alpha: float) -> bool:
    """mul: U_acc < alpha * U_rej; add: U_acc + alpha < U_rej; abs: U_acc < alpha."""
    if mode == "mul":
        return u_acc < alpha * u_rej
    if mode == "add":
        return u_acc + alpha < u_rej
    return u_acc < alpha


def seeded_generator(*parts: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from stable parts (seed, problem, step), so a resumed run samples the same."""
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))


def success_rates(task: Task, problem: Problem, tokenizer: Any, generated: list[int], conts: list[list[int]],
                  n: int) -> tuple[float, float, list[float]]:
    """Scores of the continuations; the first n follow d, the last n follow t."""
    scores = [task.score(problem, tokenizer.decode(generated + c, skip_special_tokens=True)) for c in conts]
    return sum(scores[:n]) / n, sum(scores[n:]) / n, scores


def screen_request(target: LM, problem: Problem, prompt: list[int], cfg: LabelConfig) -> RolloutRequest:
    """N completions from the prompt, to measure the target's success rate before walking."""
    gen = seeded_generator(cfg.seed, problem.id, "screen", device=target.device)
    # Continuations start with the prompt's last token (so they share one cached prefix); strip it again.
    return RolloutRequest(prompt[:-1], [prompt[-1]] * cfg.rollouts, gen, cfg.max_rollout_tokens + 1)


def walk_problem(target: LM, draft: LM, task: Task, problem: Problem, cfg: LabelConfig, stop_ids: set[int],
                 known: dict[int, dict], base: dict, emit: Callable[[dict], None],
                 judge: Callable[..., bool] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 policy: Any = None) -> Generator[RolloutRequest, list[list[int]], dict]:
    """Walk one problem, emitting a record per new candidate; ``known`` holds candidates of an earlier
    run (by step) that are reused instead of rolled out again. A generator: it yields each rollout request
    and is sent back the continuations, so a driver can batch the requests of several walks (``run_walks``).
    With a ``policy`` (``rollout_policy="pad"``) the walk continues where that policy would: d when it keeps
    d. Returns the problem's summary record."""
    prompt = encode_problem(target.tokenizer, problem, True, chat_template_kwargs)
    summary = {"type": "problem", "problem_id": problem.id, **base}
    if cfg.min_target_rate >= 0:
        conts = yield screen_request(target, problem, prompt, cfg)
        texts = [target.tokenizer.decode(c[1:], skip_special_tokens=True) for c in conts]
        rate = summary["target_rate"] = sum(task.score(problem, t) for t in texts) / len(texts)
        if rate <= cfg.min_target_rate:
            return {**summary, "status": "skipped", "candidates": 0}
    generated: list[int] = []
    sources: list[str] = []  # "override" where the walk kept d against the target (a context classifier reads it)
    n_candidates = 0
    target.reset()
    draft.reset()
    while len(generated) < cfg.max_walk_tokens:
        seq = prompt + generated
        t = int(argmax(target.advance(seq, keep_logits=1)[0][0]))
        d_logits = draft.advance(seq, keep_logits=1, full_vocab=False)[0]
        d = draft.greedy_token(d_logits[0], target.vocab_size)
        nxt = t
        if d != t:
            step = len(generated)
            kept = policy_keeps(policy, target, draft, seq, d, d_logits, sources) if policy is not None else None
            rec = known.get(step)
            if rec is not None and (rec["prefix_ids"] != seq or rec["d"] != d or rec["t"] != t):
                # The walk is deterministic, so this means the models or the file changed since that record.
                raise UsageError(f"problem {problem.id} step {step}: the labels file holds a candidate on another "
                                 "trajectory (different prefix or tokens): pass --overwrite or use another --out")
            if rec is None:
                n = cfg.rollouts
                started = time.perf_counter()
                gen = seeded_generator(cfg.seed, problem.id, step, device=target.device)
                # Without a policy the target's cache holds exactly seq here: the rollouts start from it without a
                # recompute (the policy engine prefills its own batch).
                conts = yield RolloutRequest(seq, [d] * n + [t] * n, gen, cfg.max_rollout_tokens,
                                             target.cache if policy is None else None, list(sources), d)
                u_acc, u_rej, scores = success_rates(task, problem, target.tokenizer, generated, conts, n)
                label = is_pivot(u_acc, u_rej, cfg.mode, cfg.alpha)
                rec = {"type": "candidate", "problem_id": problem.id, "step": step, "prefix_ids": seq,
                       "prompt_len": len(prompt), "d": d, "t": t, "u_acc": u_acc, "u_rej": u_rej,
                       "label": int(label), "n_rollouts": 2 * n, "rollout_tokens": sum(map(len, conts)),
                       "rollout_s": round(time.perf_counter() - started, 3),
                       **({"policy_kept": int(kept)} if kept is not None else {}), **base}
                if judge is not None and not label:
                    flipped = judge(problem, generated, conts[:n], scores[:n])
                    rec["judge_flipped"] = bool(flipped)
                    rec["label"] = int(flipped)
                emit(rec)
            n_candidates += 1
            if kept is not None:
                nxt = d if kept else t
            else:
                nxt = t if rec["label"] or cfg.follow == "target" else d
        generated.append(nxt)
        sources.append("override" if nxt != t else "target")
        if nxt in stop_ids:
            break
    return {**summary, "status": "done", "candidates": n_candidates, "walk_tokens": len(generated)}


def policy_keeps(policy: Any, target: LM, draft: LM, seq: list[int], d: int, d_logits: torch.Tensor,
                 sources: list[str]) -> bool:
    """Would ``policy`` keep draft token d after ``seq`` where SD rejects it? Asked as a PAD step asks: one
    verification of [d] from the target's rows of [last token, d] (hidden states too) and the draft's logits,
    with the answer's ``sources`` so far as its context."""
    from pivotspec.decoding.acceptance import Context, Verification
    from pivotspec.decoding.drafting import fit_vocab

    logits, hidden = target.advance(seq + [d], keep_logits=2, hidden_layer=policy.hidden_layer)
    q_logits = fit_vocab(draft.full_vocab(d_logits), target.vocab_size)
    v = Verification(torch.tensor([d], device=logits.device), logits, q_logits, SamplingConfig(), hidden,
                     context=Context.of(sources))
    return bool(policy.override(v)[0]) and not bool(v.sd_ok[0])


@dataclass
class _Walk:
    """A walk suspended at its rollout request, with the target's and the draft's cache state it left."""

    steps: Generator[RolloutRequest, list[list[int]], dict]
    request: RolloutRequest | None = None
    states: tuple = ((None, []), (None, []))


def run_walks(walks: Iterator[Generator[RolloutRequest, list[list[int]], dict]], target: LM, draft: LM,
              engine: RolloutEngine, cfg: LabelConfig, stop_ids: set[int], concurrency: int = 1
              ) -> Iterator[dict]:
    """Drive up to ``concurrency`` walks side by side: run each until it asks for rollouts, answer all their
    requests in one engine call, repeat; yield each walk's summary as it ends. The models hold one KV cache
    each, so every walk's caches are swapped in while it runs and set aside while others do."""
    scfg = SamplingConfig(cfg.temperature, 0, cfg.top_p)
    running: list[_Walk] = []
    walks = iter(walks)
    exhausted = False

    def resume(walk: _Walk, answer: list[list[int]] | None) -> dict | None:
        (target.cache, target.cached_ids), (draft.cache, draft.cached_ids) = walk.states
        try:
            walk.request, summary = walk.steps.send(answer), None
        except StopIteration as stop:
            walk.request, summary = None, stop.value
        walk.states = ((target.cache, target.cached_ids), (draft.cache, draft.cached_ids))
        # Leave the models with fresh caches: the engine must not extend (or roll back) a walk's.
        target.cache, target.cached_ids, draft.cache, draft.cached_ids = None, [], None, []
        return summary

    while running or not exhausted:
        while len(running) < concurrency and not exhausted:
            steps = next(walks, None)
            if steps is None:
                exhausted = True
                break
            walk = _Walk(steps)
            summary = resume(walk, None)
            if summary is not None:
                yield summary
            else:
                running.append(walk)
        if not running:
            continue
        answers = engine.rollouts_many([w.request for w in running], scfg, stop_ids)
        still = []
        for walk, answer in zip(running, answers, strict=True):
            summary = resume(walk, answer)
            if summary is not None:
                yield summary
            else:
                still.append(walk)
        running = still


def make_judge(judge: LM, task: Task, target_tokenizer: Any) -> Callable[..., bool]:
    """A soundness check (the authors' optional judge) with a local model: it reads the median-length
    correct rollout after d and answers Yes/No to "is every step correct?". It can only flip a non-pivot
    to a pivot. The authors used a hosted model here; any local HF causal LM works, quality varies."""
    yes = judge.tokenizer("Yes", add_special_tokens=False).input_ids[0]
    no = judge.tokenizer("No", add_special_tokens=False).input_ids[0]

    def flip(problem: Problem, generated: list[int], conts: list[list[int]], scores: list[float]) -> bool:
        correct = sorted((c for c, s in zip(conts, scores, strict=True) if s > 0), key=len)
        if not correct:
            return False
        # The rollout is the target's token ids: only the target's tokenizer can turn them into text.
        text = target_tokenizer.decode(generated + correct[len(correct) // 2], skip_special_tokens=True)
        question = problem.messages[-1]["content"] if problem.messages else problem.prompt
        ask = (f"Problem: {question}\nProposed solution: {text}\n"
               "Is every step of the proposed solution correct? Answer Yes or No.")
        judge.reset()
        logits, _ = judge.forward(encode_prompt(judge.tokenizer, ask, chat=True), keep_logits=1)
        return bool(logits[0, no] > logits[0, yes])

    return flip


class Progress:
    """One stderr line: problems, candidates, rollouts/s, ETA. Problems finished by an earlier run count
    as done but not towards the pace, which would otherwise make a resumed run's ETA far too short."""

    def __init__(self, total: int):
        self.total, self.start, self.clock = total, time.perf_counter(), time.perf_counter
        self.done = self.labeled = self.candidates = self.rollouts = 0

    def update(self, problems: int = 0, candidates: int = 0, rollouts: int = 0, resumed: int = 0) -> None:
        self.done += problems + resumed
        self.labeled += problems
        self.candidates += candidates
        self.rollouts += rollouts
        elapsed = self.clock() - self.start
        rate = self.rollouts / elapsed if elapsed else 0.0
        eta = f"{elapsed / self.labeled * (self.total - self.done) / 60:.1f} min" if self.labeled else "-"
        print(f"\rproblems {self.done}/{self.total} | candidates {self.candidates} | {rate:.1f} rollouts/s | "
              f"ETA {eta}   ", end="", file=sys.stderr, flush=True)


def run_labeling(target: LM, draft: LM, task: Task, problems: list[Problem], cfg: LabelConfig, out: Path,
                 overwrite: bool = False,
                 judge: LM | None = None, split: str = "train", progress: bool = True,
                 chat_template_kwargs: dict[str, Any] | None = None, concurrency: int = 1,
                 policy: Any = None) -> list[dict]:
    """Label ``problems`` into the JSONL file ``out``, resuming from what it already holds. ``policy``: the
    acceptance policy ``cfg.rollout_policy="pad"`` rolls out and walks under (``cfg.policy`` names it). The file is
    locked for the run, so a second labeler on the same file stops with a one-line error. ``concurrency``
    walks run side by side with their rollouts in one batch (faster; with 1, a run reproduces bit for bit
    whatever the sharding, since no candidate's rollouts share a batch with another's)."""
    with open_for_append(out, overwrite) as fh:
        return _label_locked(target, draft, task, problems, cfg, out, judge, split, progress, fh,
                             chat_template_kwargs, concurrency, policy)


def _label_locked(target: LM, draft: LM, task: Task, problems: list[Problem], cfg: LabelConfig, out: Path,
                  judge: LM | None, split: str, progress: bool, fh: Any,
                  chat_template_kwargs: dict[str, Any] | None = None, concurrency: int = 1,
                  policy: Any = None) -> list[dict]:
    if (policy is None) != (cfg.rollout_policy == "target"):
        raise UsageError("a rollout policy object goes with rollout_policy='pad', and only with it")
    base = {"task": task.name, "split": split, "config": cfg.as_dict(), "target": model_identity(target),
            "draft": model_identity(draft), "judge": judge.name if judge else None}
    existing = read_records(out)
    for rec in existing[:1]:
        diff = identity_diff(rec, base)
        if diff:
            raise UsageError(
                f"{out} was made with a different {', '.join(diff)}: pass --overwrite or use another --out")
    finished = {r["problem_id"] for r in existing if r.get("type") == "problem"}
    known: dict[str, dict[int, dict]] = {}
    for r in existing:
        if r.get("type") == "candidate":
            known.setdefault(r["problem_id"], {})[r["step"]] = r
    stop_ids = eos_ids(target)
    flip = make_judge(judge, task, target.tokenizer) if judge is not None else None
    bar = Progress(len(problems)) if progress else None

    def emit(rec: dict) -> None:
        append_record(fh, rec)
        if bar:
            bar.update(candidates=1, rollouts=rec["n_rollouts"])

    todo = [p for p in problems if p.id not in finished]
    if bar:
        bar.update(resumed=len(problems) - len(todo))
    engine = None
    if todo:  # vLLM starts only if needed
        engine = make_engine(cfg.engine, target, cfg.seed) if policy is None else PolicyEngine(target, draft, policy)
    try:
        walks = (walk_problem(target, draft, task, p, cfg, stop_ids, known.get(p.id, {}), base, emit, flip,
                              chat_template_kwargs, policy) for p in todo)
        for summary in run_walks(walks, target, draft, engine, cfg, stop_ids, concurrency):
            append_record(fh, summary)
            if bar:
                bar.update(problems=1)
    finally:
        if engine is not None:
            engine.close()
    if bar:
        print(file=sys.stderr)
    return read_records(out)
