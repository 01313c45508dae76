"""Classifier features for labeled candidates, computed by the target and cached on disk.

All candidates of one problem lie on one walked trajectory, so a single forward over the longest prefix
yields the hidden state and distribution at every candidate position of that problem. Results are cached
as safetensors keyed by the labels file's hash, the target's identity and the layer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from pivotspec.errors import UsageError
from pivotspec.models import LM, cache_dir
from pivotspec.sampling import entropy


def file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def candidates(records: list[dict], drop_unsolvable: bool = True) -> list[dict]:
    """Candidate records, de-duplicated by (problem, step); by default without rows where the target
    itself never succeeds (U_rej = 0): they carry no signal about what a token changes (authors' filter)."""
    seen, out = set(), []
    for r in records:
        if r.get("type") != "candidate" or (drop_unsolvable and r["u_rej"] == 0):
            continue
        key = (r["problem_id"], r["step"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    if not out:
        raise UsageError("the labels file has no usable candidates: label more problems first")
    return out


@torch.inference_mode()
def _model_features(lm: LM, cands: list[dict], layer: int | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Hidden states (if ``layer``) and [entropy, prob of d] at each candidate's position."""
    by_problem: dict[str, list[int]] = {}
    for i, r in enumerate(cands):
        by_problem.setdefault(r["problem_id"], []).append(i)
    hidden = [None] * len(cands)
    scalars = [None] * len(cands)
    for idx in by_problem.values():
        longest = max((cands[i]["prefix_ids"] for i in idx), key=len)
        groups = [[i for i in idx if longest[: len(cands[i]["prefix_ids"])] == cands[i]["prefix_ids"]]]
        groups += [[i] for i in idx if i not in groups[0]]  # off-trajectory rows (should not happen) on their own
        for group in groups:
            seq = max((cands[i]["prefix_ids"] for i in group), key=len)
            first = min(len(cands[i]["prefix_ids"]) for i in group) - 1
            lm.reset()
            logits, h = lm.forward(seq, keep_logits=len(seq) - first, hidden_layer=layer)
            probs = torch.softmax(logits, dim=-1)
            for i in group:
                row = len(cands[i]["prefix_ids"]) - 1 - first
                d = cands[i]["d"]
                scalars[i] = torch.stack([entropy(probs[row]), probs[row, d]])
                if h is not None:
                    hidden[i] = h[row]
    return (torch.stack(hidden) if layer is not None else None), torch.stack(scalars)


def extract(target: LM, records: list[dict], layer: int, draft: LM | None = None,
            cache_key: str | None = None) -> dict[str, torch.Tensor]:
    """{"hidden": [n, d], "scalars": [n, 2 or 4], "labels": [n], "group": [n] problem index}."""
    from safetensors.torch import load_file, save_file

    cands = candidates(records)
    path = None
    if cache_key:
        ident = json.dumps([cache_key, target.name, target.num_layers, target.d_model, layer,
                            draft.name if draft else None])
        path = cache_dir() / "features" / f"{hashlib.sha256(ident.encode()).hexdigest()[:20]}.safetensors"
        if path.is_file():
            return load_file(str(path))
    hidden, scalars = _model_features(target, cands, layer)
    if draft is not None:
        _, draft_scalars = _model_features(draft, cands, None)
        scalars = torch.cat([scalars, draft_scalars], dim=-1)
    problems = {p: i for i, p in enumerate(dict.fromkeys(r["problem_id"] for r in cands))}
    feats = {"hidden": hidden.contiguous(), "scalars": scalars.contiguous(),
             "labels": torch.tensor([int(r["label"]) for r in cands]),
             "group": torch.tensor([problems[r["problem_id"]] for r in cands])}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(feats, str(tmp))
        tmp.replace(path)
    return feats


def split_by_problem(groups: torch.Tensor, val_fraction: float = 0.2, seed: int = 0) -> torch.Tensor:
    """Boolean mask of validation rows; whole problems go to one side, so no problem is on both."""
    ids = torch.unique(groups)
    perm = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    n_val = max(1, round(val_fraction * len(ids))) if len(ids) > 1 else 0
    return torch.isin(groups, perm[:n_val])
