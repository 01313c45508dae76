"""Pivot labeling: pivots found on a toy task with a known answer, resumable and crash-safe output."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from pivotspec import api, store
from pivotspec.cli import main
from pivotspec.errors import UsageError
from pivotspec.labels import walk
from pivotspec.labels.files import label_stats
from pivotspec.labels.walk import LabelConfig, is_pivot, run_labeling
from pivotspec.tasks import Problem


class FirstTokenTask:
    """Utility 1 iff the first generated word is in ``allowed``: the first token alone decides."""

    name = "first-token"

    def __init__(self, prompts: list[str], allowed: set[str]):
        self.prompts, self.allowed = prompts, allowed

    def problems(self, split, n, seed=0):
        return [Problem(id=f"toy-{i}", prompt=p, answer=None) for i, p in enumerate(self.prompts[:n])]

    def score(self, problem, completion):
        words = completion.split()
        return float(bool(words) and words[0] in self.allowed)


def first_disagreement(target, draft, seed: int = 0) -> tuple[str, str, str]:
    """A prompt where target and draft disagree on the first greedy token, and the two tokens."""
    rng = random.Random(seed)
    for _ in range(500):
        prompt = " ".join(f"w{rng.randrange(30)}" for _ in range(rng.randint(2, 6)))
        ids = target.tokenizer(prompt).input_ids
        target.reset()
        draft.reset()
        t = int(target.forward(ids)[0][0].argmax())
        d = int(draft.forward(ids)[0][0].argmax())
        if t != d and 1 not in (t, d):
            return prompt, target.tokenizer.decode([t]), target.tokenizer.decode([d])
    raise AssertionError("no disagreement found")


CFG = dict(rollouts=4, max_rollout_tokens=4, max_walk_tokens=6, min_target_rate=-1.0, mode="mul", alpha=0.5)


@pytest.fixture
def pair(tiny_dir, load):
    return load(tiny_dir["llama_target"]), load(tiny_dir["llama_draft"])


def first_candidate(records):
    return next(r for r in records if r["type"] == "candidate" and r["step"] == 0)


def test_destructive_mismatch_is_pivot_and_harmless_one_is_not(pair, tmp_path):
    target, draft = pair
    prompt, t, d = first_disagreement(target, draft)
    cfg = LabelConfig(**CFG)
    only_t = FirstTokenTask([prompt], {t})
    recs = run_labeling(target, draft, only_t, only_t.problems("train", 1), cfg, tmp_path / "a.jsonl", progress=False)
    rec = first_candidate(recs)
    assert (rec["u_acc"], rec["u_rej"], rec["label"]) == (0.0, 1.0, 1)
    both = FirstTokenTask([prompt], {t, d})
    recs = run_labeling(target, draft, both, both.problems("train", 1), cfg, tmp_path / "b.jsonl", progress=False)
    rec = first_candidate(recs)
    assert (rec["u_acc"], rec["u_rej"], rec["label"]) == (1.0, 1.0, 0)
    # A non-pivot d is followed, so the walk's next prefix continues with d.
    nxt = next((r for r in recs if r["type"] == "candidate" and r["step"] > 0), None)
    if nxt is not None:
        assert nxt["prefix_ids"][rec["prompt_len"]] == rec["d"]


def toy(pair, n=4):
    target, draft = pair
    prompts = [first_disagreement(target, draft, seed=s)[0] for s in range(n)]
    _, t, _ = first_disagreement(target, draft, seed=0)
    return FirstTokenTask(prompts, {t})


def test_interrupted_run_resumes_to_the_same_records(pair, tmp_path, monkeypatch):
    task = toy(pair)
    cfg = LabelConfig(**{**CFG, "temperature": 1.0})
    full = run_labeling(*pair, task, task.problems("train", 4), cfg, tmp_path / "full.jsonl", progress=False)
    assert sum(r["type"] == "candidate" for r in full) >= 3

    calls = {"n": 0}
    real_append = store.append_record

    def dying_append(fh, rec):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        real_append(fh, rec)

    out = tmp_path / "resumed.jsonl"
    monkeypatch.setattr(walk, "append_record", dying_append)  # where the labeler writes each record
    with pytest.raises(KeyboardInterrupt):
        run_labeling(*pair, task, task.problems("train", 4), cfg, out, progress=False)
    monkeypatch.setattr(walk, "append_record", real_append)
    assert len(store.read_records(out)) == 3
    # Kill mid-write too: a partial last line must be dropped, not kept or duplicated.
    with out.open("a") as fh:
        fh.write('{"type": "candidate", "problem_id": "toy-1", "st')
    resumed = run_labeling(*pair, task, task.problems("train", 4), cfg, out, progress=False)
    assert without_timing(resumed) == without_timing(full)
    assert len(resumed) == len({(r["type"], r["problem_id"], r.get("step", -1)) for r in resumed})
    again = run_labeling(*pair, task, task.problems("train", 4), cfg, out, progress=False)
    assert again == resumed  # a finished file is left alone


def without_timing(records: list[dict]) -> list[dict]:
    key = lambda r: (r["type"], r["problem_id"], r.get("step", -1))  # noqa: E731
    return [{k: v for k, v in r.items() if k != "rollout_s"} for r in sorted(records, key=key)]


@pytest.mark.parametrize("screen", [-1.0, 0.0])
def test_walks_side_by_side_label_like_one_at_a_time(pair, tmp_path, monkeypatch, screen):
    from pivotspec.labels import rollouts

    task = toy(pair, n=6)  # prompts of 2 to 6 words: the batched prefixes differ in length
    cfg = LabelConfig(**{**CFG, "temperature": 1.0, "max_rollout_tokens": 8, "max_walk_tokens": 10,
                         "min_target_rate": screen})
    one = run_labeling(*pair, task, task.problems("train", 6), cfg, tmp_path / "one.jsonl", progress=False)
    batch_sizes = []
    real = rollouts.padded_rollouts

    def counting(lm, requests, *args):
        batch_sizes.append(len(requests))
        return real(lm, requests, *args)

    monkeypatch.setattr(rollouts, "padded_rollouts", counting)
    four = run_labeling(*pair, task, task.problems("train", 6), cfg, tmp_path / "four.jsonl", progress=False,
                        concurrency=4)
    assert max(batch_sizes) > 1  # requests of several walks did share a batch
    assert sum(r["type"] == "candidate" for r in one) >= 3
    assert without_timing(four) == without_timing(one)
    with pytest.raises(UsageError, match="--concurrency"):
        api.check_label(concurrency=0)


def test_resume_refuses_a_different_configuration(pair, tmp_path):
    task = toy(pair, n=1)
    out = tmp_path / "l.jsonl"
    run_labeling(*pair, task, task.problems("train", 1), LabelConfig(**CFG), out, progress=False)
    with pytest.raises(UsageError, match="different config"):
        run_labeling(*pair, task, task.problems("train", 1), LabelConfig(**{**CFG, "alpha": 0.9}), out,
                     progress=False)
    cfg = LabelConfig(**{**CFG, "alpha": 0.9})
    recs = run_labeling(*pair, task, task.problems("train", 1), cfg, out, overwrite=True, progress=False)
    fresh = run_labeling(*pair, task, task.problems("train", 1), cfg, tmp_path / "fresh.jsonl", progress=False)
    assert without_timing(recs) == without_timing(fresh)  # nothing of the first run is left in the file
    cands = [r for r in recs if r["type"] == "candidate"]
    assert cands and all(r["label"] == is_pivot(r["u_acc"], r["u_rej"], "mul", 0.9) for r in cands)


def test_label_resumes_in_the_dtype_its_file_was_made_in(tmp_path, monkeypatch, capsys):
    """Auto may pick bfloat16 on one CPU and float32 on another; a resumed run takes the file's dtype (a
    resume in another dtype would be refused), and --dtype or --overwrite still decide."""
    import gzip

    out = tmp_path / "l.jsonl"
    assert api.labels_dtype(out) is None
    record = {"type": "candidate", "target": {"name": "t", "dtype": "float32"}}
    out.with_name("l.jsonl.gz").write_bytes(gzip.compress((json.dumps(record) + "\n").encode()))
    assert api.labels_dtype(out) == "float32"  # read from the compressed copy
    out.write_text(json.dumps({**record, "target": {"name": "t"}}) + "\n")
    assert api.labels_dtype(out) == "float32"  # files from before the dtype was recorded were float32
    out.write_text(json.dumps({**record, "target": {"name": "t", "dtype": "bfloat16"}}) + "\n")
    seen = []

    def load_pair(args, needs_draft):
        seen.append(args.dtype)
        raise SystemExit(0)

    monkeypatch.setattr("pivotspec.cli.labels.load_pair", load_pair)
    for extra in ([], ["--dtype", "float32"], ["--overwrite"]):
        with pytest.raises(SystemExit):
            main(["label", "--pair", "testbed", "--out", str(out), *extra])
    assert seen == ["bfloat16", "float32", None]
    assert "in bfloat16, the dtype it was made in" in capsys.readouterr().err


def test_truncated_file_repair_and_malformed_middle_line(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"a": 1}\n{"a": 2}\n{"a": 3')
    assert store.read_records(f) == [{"a": 1}, {"a": 2}]
    assert f.read_text() == '{"a": 1}\n{"a": 2}\n'
    f.write_text('{"a": 1}\nnot json\n{"a": 3}\n')
    with pytest.raises(UsageError, match="x.jsonl:2: malformed"):
        store.read_records(f)


def test_pivot_rules():
    assert is_pivot(0.2, 0.9, "mul", 0.5) and not is_pivot(0.5, 0.9, "mul", 0.5)
    assert is_pivot(0.2, 0.9, "add", 0.5) and not is_pivot(0.5, 0.9, "add", 0.5)
    assert is_pivot(0.2, 0.9, "abs", 0.3) and not is_pivot(0.4, 0.9, "abs", 0.3)


@pytest.mark.parametrize("kwargs,match", [({"rollouts": 0}, "--rollouts"), ({"alpha": 1.5}, "--alpha"),
                                          ({"alpha": 0.0}, "--alpha"), ({"mode": "x"}, "--mode"),
                                          ({"temperature": -1}, "temperature")])
def test_bad_label_config(kwargs, match):
    with pytest.raises(UsageError, match=match):
        LabelConfig(**kwargs)


def test_label_cli_errors_and_stats(tiny_dir, tmp_path, capsys):
    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    for argv, expected in [
        (["label", "--target", t, "--draft", d, "--task", "nope", "--out", str(tmp_path / "o.jsonl")], "unknown task"),
        (["label", "--target", t, "--draft", d, "--rollouts", "0", "--out", str(tmp_path / "o.jsonl")], "--rollouts"),
        (["label", "--target", t, "--draft", d, "--alpha", "2", "--out", str(tmp_path / "o.jsonl")], "--alpha"),
        (["labels", "stats", str(tmp_path / "missing.jsonl")], "does not exist"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, err
    f = tmp_path / "s.jsonl"
    recs = [{"type": "candidate", "problem_id": "p", "step": i, "u_acc": i / 4, "u_rej": 1.0, "label": int(i < 2),
             "n_rollouts": 8} for i in range(4)] + [{"type": "problem", "problem_id": "p", "status": "done"}]
    recs[0]["rollout_s"] = recs[1]["rollout_s"] = 2.0  # older records lack the field: ignored for the rate
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["labels", "stats", str(f), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats == label_stats(recs)
    assert stats["candidates"] == 4 and stats["pivots"] == 2 and stats["pivot_share"] == 0.5
    assert stats["u_acc_hist"][0] == 1 and stats["u_rej_hist"][9] == 4
    assert stats["rollouts_per_s"] == 4.0 and stats["rollout_s"] == 4.0
    share = {(r["mode"], r["alpha"]): r["pivot_share"] for r in stats["rule_sweep"]}
    assert share[("mul", 0.5)] == 0.5 and share[("abs", 0.7)] == 0.75 and share[("add", 0.3)] == 0.75
    assert main(["labels", "stats", str(f)]) == 0
    assert "mul 0.5: 0.500" in capsys.readouterr().out


def test_judge_only_flips_non_pivots_to_pivots(pair, tmp_path, monkeypatch):
    from pivotspec.labels import walk as labeling

    target, draft = pair
    prompt, t, d = first_disagreement(target, draft)
    both = FirstTokenTask([prompt], {t, d})  # the first candidate is a non-pivot by rollouts
    asked = []

    def always_flip(judge, task, target_tokenizer):
        return lambda problem, generated, conts, scores: asked.append(len(conts)) or True

    monkeypatch.setattr(labeling, "make_judge", always_flip)
    recs = run_labeling(target, draft, both, both.problems("train", 1), LabelConfig(**CFG), tmp_path / "j.jsonl",
                        judge=target, progress=False)
    rec = first_candidate(recs)
    assert rec["judge_flipped"] is True and rec["label"] == 1 and (rec["u_acc"], rec["u_rej"]) == (1.0, 1.0)
    assert asked and all(n == CFG["rollouts"] for n in asked)
    only_t = FirstTokenTask([prompt], {t})  # a pivot by rollouts: the judge is not asked
    asked.clear()
    recs = run_labeling(target, draft, only_t, only_t.problems("train", 1), LabelConfig(**CFG), tmp_path / "k.jsonl",
                        judge=target, progress=False)
    assert first_candidate(recs)["label"] == 1 and "judge_flipped" not in first_candidate(recs)


def test_real_judge_runs_on_a_local_model(pair, tmp_path):
    target, draft = pair
    prompt, t, d = first_disagreement(target, draft)
    both = FirstTokenTask([prompt], {t, d})
    recs = run_labeling(target, draft, both, both.problems("train", 1), LabelConfig(**CFG), tmp_path / "r.jsonl",
                        judge=draft, progress=False)
    rec = first_candidate(recs)
    assert isinstance(rec["judge_flipped"], bool) and rec["label"] == int(rec["judge_flipped"])
    assert recs[0]["judge"] == draft.name


def test_judge_reads_rollouts_with_the_targets_tokenizer(pair, monkeypatch):
    """Rollouts are target token ids: a judge with another tokenizer must see the target's text."""
    from types import SimpleNamespace

    target, _ = pair
    asked = []
    monkeypatch.setattr(walk, "encode_prompt", lambda tok, text, chat=True: asked.append(text) or [3, 4])

    def judge_tokenizer(text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[5])

    judge_tokenizer.decode = lambda ids, **kw: "JUDGE-TOKENIZER"  # what decoding with the wrong tokenizer gives
    judge = SimpleNamespace(tokenizer=judge_tokenizer, reset=lambda: None,
                            forward=lambda ids, keep_logits=1: (torch.zeros(1, 32), None))
    flip = walk.make_judge(judge, None, target.tokenizer)
    problem = Problem(id="p", prompt="q", answer=None)
    flip(problem, [5, 6], [[7, 8]], [1.0])
    assert target.tokenizer.decode([5, 6, 7, 8]) in asked[0] and "JUDGE-TOKENIZER" not in asked[0]


def test_resume_refuses_a_candidate_from_another_trajectory(pair, tmp_path):
    task = toy(pair, n=1)
    out = tmp_path / "l.jsonl"
    run_labeling(*pair, task, task.problems("train", 1), LabelConfig(**CFG), out, progress=False)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    cand = next(r for r in recs if r["type"] == "candidate")
    cand["prefix_ids"] = cand["prefix_ids"][:-1] + [cand["prefix_ids"][-1] + 1]  # another trajectory
    # drop the problem's summary so the rerun walks it again and meets the stored candidate
    out.write_text("".join(json.dumps(r) + "\n" for r in recs if r["type"] != "problem"))
    with pytest.raises(UsageError, match="another trajectory"):
        run_labeling(*pair, task, task.problems("train", 1), LabelConfig(**CFG), out, progress=False)


def test_second_writer_is_refused(pair, tmp_path):
    from pivotspec.store import lock_for_append

    task = toy(pair, n=1)
    out = tmp_path / "l.jsonl"
    with out.open("a") as fh:
        lock_for_append(fh, out)  # as if another labeler were running
        with pytest.raises(UsageError, match="another pivotspec process is writing"):
            run_labeling(*pair, task, task.problems("train", 1), LabelConfig(**CFG), out, progress=False)
    records = run_labeling(*pair, task, task.problems("train", 1), LabelConfig(**CFG), out, progress=False)
    assert records == store.read_records(out) and records[-1]["type"] == "problem"  # once free, it labels


def test_progress_eta_ignores_resumed_problems(capsys):
    from pivotspec.labels.walk import Progress

    bar = Progress(10)
    bar.clock = lambda: bar.start + 60.0  # one minute has passed
    for _ in range(5):
        bar.update(resumed=1)  # finished by an earlier run: instant, must not set the pace
    bar.update(problems=1, candidates=2, rollouts=40)
    line = capsys.readouterr().err.split("\r")[-1]
    assert "problems 6/10" in line and "candidates 2" in line
    assert "ETA 4.0 min" in line  # 1 problem per minute, 4 to go
    assert "0.7 rollouts/s" in line


def test_shards_cover_each_problem_once_and_merge_to_the_unsharded_run(tiny_dir, tmp_path, capsys):
    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    base = ["label", "--target", t, "--draft", d, "--task", "arith", "--n-problems", "6", "--rollouts", "2",
            "--max-rollout-tokens", "3", "--max-walk-tokens", "5", "--min-target-rate", "-1"]
    assert main([*base, "--out", str(tmp_path / "all.jsonl")]) == 0
    shards = [tmp_path / f"s{i}.jsonl" for i in range(3)]
    for i, path in enumerate(shards):
        assert main([*base, "--shard", f"{i}/3", "--out", str(path)]) == 0
    owners = [{r["problem_id"] for r in store.read_records(p) if r["type"] == "problem"} for p in shards]
    assert sum(map(len, owners)) == 6 and len(set().union(*owners)) == 6  # each problem in exactly one shard
    merged = tmp_path / "merged.jsonl"
    assert main(["labels", "merge", str(merged), *map(str, shards), str(shards[0])]) == 0  # a repeat is dropped

    def key(rows):
        return sorted((r["type"], r["problem_id"], r.get("step"), r.get("label"), r.get("u_acc"), r.get("u_rej"))
                      for r in rows)

    assert key(store.read_records(merged)) == key(store.read_records(tmp_path / "all.jsonl"))
    capsys.readouterr()
    assert main(["labels", "merge", str(merged), str(shards[0])]) == 2 and "--overwrite" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    assert main([*base, "--alpha", "0.3", "--n-problems", "1", "--out", str(other)]) == 0
    capsys.readouterr()
    assert main(["labels", "merge", str(tmp_path / "x.jsonl"), str(shards[0]), str(other)]) == 2
    assert "different config" in capsys.readouterr().err
    assert main([*base, "--shard", "3/3", "--out", str(other)]) == 2


def test_on_policy_labels_walk_where_the_policy_goes_and_name_it(pair, tmp_path):
    """--rollout-policy pad: a policy that keeps every draft walks d at every candidate, one that keeps none
    walks t (the trajectory of --follow target); each record says what the policy did, the config names the
    policy, and a file labeled under one policy is not resumed under another."""
    from pivotspec.decoding.acceptance import PAD, constant_classifier

    task = toy(pair, n=2)
    keep_all = PAD(constant_classifier(0.0), sigma=1.0, p_floor=0.0)
    keep_none = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)
    on = {**CFG, "rollout_policy": "pad", "follow": "policy"}
    recs = run_labeling(*pair, task, task.problems("train", 2), LabelConfig(**on, policy="keep-all"),
                        tmp_path / "all.jsonl", progress=False, policy=keep_all)
    cands = [r for r in recs if r["type"] == "candidate"]
    assert cands and all(r["policy_kept"] == 1 for r in cands)
    assert all(r["config"]["rollout_policy"] == "pad" and r["config"]["policy"] == "keep-all" for r in cands)
    for a, b in zip(cands, cands[1:], strict=False):  # the next candidate's prefix holds the kept d
        if a["problem_id"] == b["problem_id"]:
            assert b["prefix_ids"][len(a["prefix_ids"])] == a["d"]
    none = run_labeling(*pair, task, task.problems("train", 2), LabelConfig(**on, policy="keep-none"),
                        tmp_path / "none.jsonl", progress=False, policy=keep_none)
    by_target = run_labeling(*pair, task, task.problems("train", 2), LabelConfig(**{**CFG, "follow": "target"}),
                             tmp_path / "t.jsonl", progress=False)
    steps = lambda rs: [(r["problem_id"], r["step"], r["prefix_ids"]) for r in rs if r["type"] == "candidate"]  # noqa: E731
    assert steps(none) == steps(by_target) and all(r["policy_kept"] == 0 for r in none if r["type"] == "candidate")
    with pytest.raises(UsageError, match="config"):
        run_labeling(*pair, task, task.problems("train", 2), LabelConfig(**on, policy="another"),
                     tmp_path / "all.jsonl", progress=False, policy=keep_all)
    assert "rollout_policy" not in LabelConfig(**CFG).as_dict()  # target-only files keep their old config


def test_rollout_policy_arguments(tiny_dir, tmp_path):
    with pytest.raises(UsageError, match="needs the policy|--follow policy"):
        LabelConfig(**CFG, rollout_policy="pad")
    with pytest.raises(UsageError, match="go with --rollout-policy pad"):
        api.check_label(task="arith", policy_sigma=0.3)
    with pytest.raises(UsageError, match="torch engine"):
        LabelConfig(**CFG, rollout_policy="pad", follow="policy", policy="p", engine="vllm")
    fields, policy = api.rollout_policy(None, {"rollout_policy": "pad", "policy_classifier": "const:0.2",
                                              "policy_sigma": 0.4})
    assert fields["follow"] == "policy" and fields["policy"] == "pad(sigma=0.4,p_floor=0.0001,gamma=5) const:0.2"
    shipped = api.default_classifier("testbed")  # named by directory and hash, not path: resumable elsewhere
    fields, _ = api.rollout_policy(None, {"rollout_policy": "pad", "policy_classifier": shipped, "policy_sigma": 0.3})
    assert re.fullmatch(r"pad\(sigma=0.3,p_floor=0.0001,gamma=5\) classifier#[0-9a-f]{12}", fields["policy"])
    assert main(["label", "--target", str(tiny_dir["llama_target"]), "--draft", str(tiny_dir["llama_draft"]),
                 "--task", "arith", "--n-problems", "1", "--rollouts", "2", "--max-walk-tokens", "4",
                 "--max-rollout-tokens", "4", "--min-target-rate", "-1", "--rollout-policy", "pad",
                 "--policy-classifier", "const:0.2", "--policy-sigma", "0.4", "--out", str(tmp_path / "p.jsonl")]) == 0
    recs = store.read_records(tmp_path / "p.jsonl")
    assert recs[-1]["config"]["policy"] == "pad(sigma=0.4,p_floor=0.0001,gamma=5) const:0.2"
