"""Classifier features for labeled candidates, computed by the target and cached on disk.

Each candidate's features come from the same rows, through the same function, as a PAD step's (see
``classifier.model_inputs``). Results are cached as safetensors keyed by the labels file's hash, the
target's identity, the layer and ``FEATURES_VERSION``.
"""

from __future__ import annotations

import hashlib
import json

import torch

from pivotspec.decoding.acceptance import Context
from pivotspec.decoding.drafting import fit_vocab
from pivotspec.decoding.models import LM, cache_dir
from pivotspec.errors import UsageError
from pivotspec.store import content_digest

# Bumped whenever what a feature means changes, so no cached file of an older meaning is read back.
# 2: the hidden state at d's own row (1 read the row that predicts d).
FEATURES_VERSION = 2
CANDIDATE_KEYS = ("problem_id", "step", "prefix_ids", "d", "label", "u_acc", "u_rej")


file_hash = content_digest  # labels files are keyed by their plain content, also when kept compressed


def candidates(records: list[dict]) -> list[dict]:
    """Candidate records, de-duplicated by (file, problem, step) (the first record wins)."""
    seen, out = set(), []
    for n, r in enumerate(records, 1):
        if r.get("type") != "candidate":
            continue
        missing = [k for k in CANDIDATE_KEYS if k not in r]
        if missing:
            raise UsageError(f"labels record {n} lacks {', '.join(missing)}: this is not a file written by "
                             "`pivotspec label` (or it was edited); relabel or fix it")
        key = (r.get("source", 0), r["problem_id"], r["step"])  # source: which of several files (rounds)
        if key not in seen:
            seen.add(key)
            out.append(r)
    if not out:
        raise UsageError("the labels file has no candidates: label more problems first")
    return out


def contexts(cands: list[dict]) -> list[Context]:
    """Each candidate's ``acceptance.Context``: the walk that found it kept d (a harmless label, or the policy's
    override) at an earlier candidate exactly when d, not t, stands at that step in this candidate's prefix."""
    earlier: dict[tuple, list[dict]] = {}
    for r in sorted(cands, key=lambda r: r["step"]):
        earlier.setdefault((r.get("source", 0), r["problem_id"]), []).append(r)
    out = []
    for r in cands:
        prefix = r["prefix_ids"]
        start = len(prefix) - r["step"]  # the prompt's length: the walk's step counts the tokens it generated
        kept = [e["step"] for e in earlier[(r.get("source", 0), r["problem_id"])]
                if e["step"] < r["step"] and prefix[start + e["step"]] == e["d"]]
        out.append(Context(r["step"], len(kept), r["step"] - 1 - kept[-1] if kept else r["step"]))
    return out


def context_columns(cands: list[dict]) -> torch.Tensor:
    """[n, N_CONTEXT] the context classifier's extra inputs per candidate, through ``model.context_features``
    (the function a decoding step calls), a candidate being a one-token step that SD rejected."""
    from pivotspec.classifier.model import N_CONTEXT, context_features

    rejected = torch.zeros(1, dtype=torch.bool)
    rows = [context_features(c, rejected)[0] for c in contexts(cands)]
    return torch.stack(rows) if rows else torch.zeros(0, N_CONTEXT)


@torch.inference_mode()
def _model_features(target: LM, cands: list[dict], layer: int | None,
                    draft: LM | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Hidden states (if ``layer``) and scalars for each candidate, computed the way a PAD step computes
    them: the target advances over prefix + [d] and returns the rows of [last prefix token, d], which
    ``classifier.model_inputs`` turns into inputs exactly as it does for a verification forward. Candidates
    of one problem lie on one walked trajectory, so taken in step order each advance reuses the cache and
    feeds only the tokens since the previous candidate (rolling back a d the walk did not follow)."""
    from pivotspec.classifier.model import model_inputs

    kind = "extended" if draft is not None else "extended_v2"
    hidden = [None] * len(cands)
    scalars = [None] * len(cands)
    order = sorted(range(len(cands)), key=lambda i: (cands[i]["problem_id"], len(cands[i]["prefix_ids"])))
    for m in (target, draft):
        if m is not None:
            m.reset()
    for i in order:
        prefix, d = cands[i]["prefix_ids"], cands[i]["d"]
        logits, h = target.advance(prefix + [d], keep_logits=2, hidden_layer=layer)
        q = None
        if draft is not None:
            q = torch.softmax(fit_vocab(draft.advance(prefix, keep_logits=1)[0], target.vocab_size), dim=-1)
        h_i, s_i = model_inputs(kind, h, torch.softmax(logits, dim=-1), torch.tensor([d], device=logits.device), q)
        scalars[i] = s_i[0]
        if h_i is not None:
            hidden[i] = h_i[0]
    # Training runs on the CPU whatever device the target decodes on.
    return (torch.stack(hidden).cpu() if layer is not None else None), torch.stack(scalars).cpu()


def extract(target: LM, records: list[dict], layer: int, draft: LM | None = None,
            cache_key: str | None = None) -> dict[str, torch.Tensor]:
    """Features of every candidate: {"hidden": [n, d], "scalars": [n, 2, or 4 with a draft], "context": [n, 3],
    "labels",
    "u_acc", "u_rej": [n], "group": [n] problem index}. Filters are applied later, by the caller."""
    from safetensors.torch import load_file, save_file

    layer = target.resolve_layer(layer)
    cands = candidates(records)
    path = None
    if cache_key:
        # device and dtype too: bfloat16 hidden states are other features than float32 ones (an AUROC measured
        # in bfloat16 must not read float32's cached rows)
        # (written as str(model.dtype) wrote it before int8 existed, so the cached rows stay valid; int8 and
        # bfloat16 on the row-wise kernel compute other numbers than on PyTorch's or oneDNN's: " rowwise")
        rowwise = " rowwise" if target.placement.endswith(" rowwise") else ""
        ident = json.dumps([FEATURES_VERSION, cache_key, target.name, target.num_layers, target.d_model, layer,
                            draft.name if draft else None, target.device.type,
                            f"torch.{target.weights_dtype}{rowwise}"])
        path = cache_dir() / "features" / f"{hashlib.sha256(ident.encode()).hexdigest()[:20]}.safetensors"
        if path.is_file():
            return {**load_file(str(path)), "context": context_columns(cands)}
    hidden, scalars = _model_features(target, cands, layer, draft)
    problems = {p: i for i, p in enumerate(dict.fromkeys(r["problem_id"] for r in cands))}
    feats = {"hidden": hidden.contiguous(), "scalars": scalars.contiguous(),
             "labels": torch.tensor([int(r["label"]) for r in cands]),
             "u_acc": torch.tensor([float(r["u_acc"]) for r in cands]),
             "u_rej": torch.tensor([float(r["u_rej"]) for r in cands]),
             "group": torch.tensor([problems[r["problem_id"]] for r in cands])}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(feats, str(tmp))
        tmp.replace(path)
    return {**feats, "context": context_columns(cands)}  # from the records alone: cheap, so never cached


SPLITS = ("train", "selection", "report")


def split_by_problem(groups: torch.Tensor, fractions: tuple[float, float] = (0.2, 0.2),
                     seed: int = 0) -> torch.Tensor:
    """Per row 0 (train), 1 (selection: early stopping, sweep, sigma) or 2 (report: held-out metrics).
    Whole problems go to one split, so no problem is on two sides; ``fractions`` are selection's and
    report's shares of the problems."""
    ids = torch.unique(groups)
    perm = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    n_sel = max(1, round(fractions[0] * len(ids))) if len(ids) > 2 else 0
    n_rep = max(1, round(fractions[1] * len(ids))) if len(ids) > 2 else 0
    split = torch.zeros_like(groups)
    split[torch.isin(groups, perm[:n_sel])] = 1
    split[torch.isin(groups, perm[n_sel:n_sel + n_rep])] = 2
    return split


def split_by_round(groups: torch.Tensor, rounds: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Per row its split when the rows come from several labels files (rounds, in order): the first file's
    problems are split as that file alone would be (:func:`split_by_problem`), each later file's new problems
    among themselves, and a problem keeps the split it first got. So a classifier trained on a union of rounds
    is held out on the first round's report problems, and classifiers of different rounds compare there.
    (A permutation over the union's problems would put most of them elsewhere: 27 of round 0's 34 report
    problems trained the first union classifier, benchmarks/round_reports.py.)"""
    of_problem: dict[int, int] = {}
    for k in torch.unique(rounds).tolist():
        new = (rounds == k) & ~torch.isin(groups, torch.tensor(list(of_problem), dtype=groups.dtype))
        if new.any():
            got = split_by_problem(groups[new], seed=seed)
            of_problem.update(zip(groups[new].tolist(), got.tolist(), strict=True))
    return torch.tensor([of_problem[g] for g in groups.tolist()], dtype=groups.dtype)
