"""The pivot classifier: learns separable features, round-trips, refuses the wrong target, and sees the
same features at decode time as offline."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pivotspec.classifier import features, metrics
from pivotspec.classifier import model as clf
from pivotspec.classifier.model import load_for_target
from pivotspec.classifier.training import inputs as training_inputs
from pivotspec.classifier.training import train_from_labels
from pivotspec.cli import main
from pivotspec.decoding.acceptance import PAD
from pivotspec.decoding.loop import decode
from pivotspec.errors import UsageError


def synthetic(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < 0.3).long()
    direction = torch.randn(d, generator=g)
    h = torch.randn(n, d, generator=g) + 1.5 * y[:, None] * direction / direction.norm() * 2
    s = torch.stack([torch.rand(n, generator=g) + y, torch.rand(n, generator=g) - 0.5 * y], dim=-1)
    return h, s, y


@pytest.mark.parametrize("kind", ["extended_v2", "mlp", "linear"])
def test_learns_separable_features(kind):
    h_all, s_all, y_all = synthetic(900, 32, 0)  # one draw: train on 600 rows, validate on the other 300
    h, s, y = h_all[:600], s_all[:600], y_all[:600]
    hv, sv, yv = h_all[600:], s_all[600:], y_all[600:]
    k = clf.n_scalars(kind)
    net, _ = clf.train(kind, 32, (h, s[:, :k] if k else None), y, (hv, sv[:, :k] if k else None), yv, epochs=300,
                       seed=0)
    scores = clf.pivot_scores(net, hv, sv[:, :k] if k else None)
    assert metrics.auroc(scores, yv) > 0.95


def test_metrics_on_known_values():
    scores, labels = torch.tensor([0.9, 0.8, 0.3, 0.1]), torch.tensor([1, 0, 1, 0])
    assert metrics.auroc(scores, labels) == pytest.approx(0.75)
    assert metrics.average_precision(scores, labels) == pytest.approx((1.0 + 2 / 3) / 2)
    t = metrics.at_threshold(scores, labels, 0.5)
    assert (t["tp"], t["fp"], t["fn"], t["tn"]) == (1, 1, 1, 1)


def test_calibrated_sigma_meets_recall():
    g = torch.Generator().manual_seed(1)
    scores, labels = torch.rand(500, generator=g), (torch.rand(500, generator=g) < 0.4).long()
    for r in (0.5, 0.8, 0.95, 1.0):
        sigma = clf.calibrate_sigma(scores, labels, r)
        assert metrics.at_threshold(scores, labels, sigma)["recall"] >= r
        # a slightly larger sigma would break the target (sigma is the largest on the 1e-4 grid)
        if sigma < 1.0:
            assert metrics.at_threshold(scores, labels, sigma + 2e-4)["recall"] < r or sigma + 2e-4 > 1


def fake_labels(path, n_problems=15, seed=0):
    """Labels whose pivot rule is known: d is a pivot when its token id is even (and then keeping it drops the
    utility by 0.8, else by nothing)."""
    rng = random.Random(seed)
    lines = []
    for p in range(n_problems):
        prefix = [rng.randrange(2, 32) for _ in range(4)]
        for step in range(8):
            d = rng.randrange(2, 32)
            lines.append({"type": "candidate", "problem_id": f"p{p}", "step": step, "prefix_ids": prefix[:],
                          "prompt_len": 4, "d": d, "t": (d + 1) % 30 + 2, "u_acc": 0.9 - 0.8 * (d % 2 == 0),
                          "u_rej": 0.9, "label": int(d % 2 == 0), "n_rollouts": 8})
            prefix.append(rng.randrange(2, 32))
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def trained_classifier(tiny_dir, tmp_path):
    """A classifier directory for the tiny llama target, trained on ``fake_labels``."""
    from pivotspec.decoding.models import load_lm

    labels = fake_labels(tmp_path / "labels.jsonl")
    train_from_labels(labels, load_lm(str(tiny_dir["llama_target"])), tmp_path / "clf", "extended_v2", layer=2,
                      epochs=200)
    return tmp_path / "clf"


@pytest.fixture(scope="module")
def trained(tiny_dir, load, tmp_path_factory):
    """Trained once for the module: the tests read the directory and never change it."""
    root = tmp_path_factory.mktemp("trained")
    out = trained_classifier(tiny_dir, root)
    config = json.loads((out / "classifier.json").read_text())
    return load(tiny_dir["llama_target"]), root / "labels.jsonl", out, config


def test_save_load_round_trip_and_plots(trained):
    target, _, out, config = trained
    net, loaded = clf.load(out)
    assert loaded == json.loads((out / "classifier.json").read_text())
    assert loaded["layer"] == 2 and loaded["target"]["name"] == target.name and 0 <= loaded["sigma"] <= 1
    assert loaded["feature_row"] == "draft_token" and set(loaded["references"]) == {"logreg_p", "logreg_entropy_p"}
    assert sum(loaded["labels"]["rows"].values()) == 120 and loaded["labels"]["problems"]["report"] == 3
    net2, _ = clf.load(out)
    h, s = torch.randn(5, target.d_model), torch.rand(5, 2)
    torch.testing.assert_close(clf.pivot_scores(net, h, s), clf.pivot_scores(net2, h, s), atol=0, rtol=0)
    assert (out / "roc.png").stat().st_size > 0 and (out / "pr.png").stat().st_size > 0


def test_incompatible_target_is_a_one_line_error(trained, tiny_dir, load, capsys, tmp_path):
    out = Path(shutil.copytree(trained[2], tmp_path / "clf"))  # a copy: the module's classifier stays as trained
    qwen = load(tiny_dir["qwen3_target"])  # same width and depth, other model
    with pytest.raises(UsageError, match="trained for target"):
        load_for_target(out, qwen)
    config = json.loads((out / "classifier.json").read_text())
    config["target"]["d_model"] = 64  # as if trained for a wider target
    (out / "classifier.json").write_text(json.dumps(config))
    code = main(["generate", "--target", str(tiny_dir["llama_target"]), "--draft", str(tiny_dir["llama_draft"]),
                 "--method", "pad", "--classifier", str(out), "--prompt", "w1 w2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "hidden size 64" in err


def test_pad_with_trained_classifier_and_eval_classifier_cli(trained, tiny_dir, capsys):
    target, labels, out, config = trained
    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    assert main(["generate", "--target", t, "--draft", d, "--method", "pad", "--classifier", str(out),
                 "--prompt", "w1 w2 w3", "--max-new-tokens", "8", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["stats"]["new_tokens"] > 0
    assert main(["eval-classifier", "--classifier", str(out), "--labels", str(labels), "--target", t,
                 "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["n"] == 120 and 0 <= rep["auroc"] <= 1 and len(rep["thresholds"]) == 9
    assert set(rep["references"]) == {"logreg_p", "logreg_entropy_p"}
    # plots land next to the labels file, never inside the classifier directory
    assert sorted(p.name for p in out.iterdir()) == ["classifier.json", "classifier.safetensors", "drop.safetensors",
                                                   "pr.png", "roc.png"]
    assert (labels.parent / "labels.eval-clf" / "roc.png").is_file()


@pytest.mark.parametrize("kind", ["extended_v2", "extended", "context"])
def test_decode_time_features_equal_training_features(tiny_dir, load, tmp_path, monkeypatch, kind):
    """Every draft token a PAD decode scores gets, from the training path (features.extract over prefix + d,
    from scratch), the very inputs the policy fed the classifier: the hidden state at d's own row, and the
    target's (and for 'extended' the draft's) entropy and p(d) from the row that predicts d. The target uses
    HF's standard init (0.02): with activations of order 1, float32 rounding between the chunked (cached) and
    the one-pass forward stays far below 1e-5. For 'context', the walk's candidates are the draft tokens on
    the answer's own path that SD rejected: their context columns, rebuilt from the records alone (which d
    the later prefixes kept), equal what the decode fed the classifier."""
    from tests.conftest import make_tiny_model

    target = load(make_tiny_model(tmp_path / "t", seed=5, layers=3, init=0.02))
    draft = load(tiny_dir["llama_draft"])
    torch.manual_seed(0)
    net = clf.PivotNet(kind, target.d_model)  # random weights: some tokens get overridden, some do not
    seen = []
    real_model_inputs = clf.model_inputs

    def recording(*args, **kwargs):
        h, s = real_model_inputs(*args, **kwargs)
        g = args[3].shape[0]
        prefix = target.cached_ids[: len(target.cached_ids) - g]  # the verification forward fed [.., d_1..d_g]
        sd_ok = args[6]().tolist() if kind == "context" else [False] * g
        for i, d in enumerate(args[3].tolist()):
            seen.append((prefix + args[3][:i].tolist(), d, h[i].clone(), s[i].clone(), sd_ok[i], n_decode[0]))
        return h, s

    monkeypatch.setattr(clf, "model_inputs", recording)
    prompts, answers, n_decode = ([3, 4, 5, 6, 7], [9, 8], [20, 21, 22, 23, 24, 25, 26]), [], [0]
    sigma = 0.5
    if kind == "context":  # a random net's scores sit in a narrow band: split it, so some overrides happen
        scores, score = [], clf.as_policy_classifier(net)
        probe = PAD(lambda v: scores.append(score(v)) or scores[-1], sigma=1.0, p_floor=0.0, hidden_layer=-2)
        for prompt in prompts:
            decode("pad", target, draft, prompt, probe, gamma=4, max_new_tokens=12, eos_ids=set())
        sigma = float(torch.cat(scores).median())
        seen.clear()
    policy = PAD(clf.as_policy_classifier(net), sigma=sigma, p_floor=0.0, hidden_layer=-2)
    for n, prompt in enumerate(prompts):
        n_decode[0] = n
        answers.append(prompt + decode("pad", target, draft, prompt, policy, gamma=4, max_new_tokens=12,
                                       eos_ids=set()).token_ids)
    monkeypatch.setattr(clf, "model_inputs", real_model_inputs)
    if kind == "context":  # the walk's view: one trajectory per problem, a candidate where SD rejected d
        seen = [x for x in seen if not x[4] and answers[x[5]][: len(x[0])] == x[0]]
        overrides_before = [float(x[3][2]) for x in seen]
        assert sum(o > 0 for o in overrides_before) >= 3 and min(overrides_before) == 0  # a mix of contexts
        assert len({(x[5], tuple(x[0])) for x in seen}) == len(seen)  # one candidate per position, as in a walk
    assert len(seen) > 12
    records = [{"type": "candidate", "problem_id": f"x{n}" if kind == "context" else f"x{i}",
                "step": len(prefix) - len(prompts[n]) if kind == "context" else 0, "prefix_ids": prefix, "d": d,
                "u_acc": 0.0, "u_rej": 1.0, "label": i % 2} for i, (prefix, d, _, _, _, n) in enumerate(seen)]
    feats = features.extract(target, records, layer=-2, draft=draft if kind == "extended" else None)
    inputs = training_inputs(kind, feats, torch.ones(len(records), dtype=torch.bool))
    torch.testing.assert_close(inputs[0], torch.stack([x[2] for x in seen]), atol=1e-5, rtol=0)
    torch.testing.assert_close(inputs[1], torch.stack([x[3] for x in seen]), atol=1e-5, rtol=1e-5)


def test_negative_layer_is_hf_hidden_states_indexing(tiny_dir, load):
    lm = load(tiny_dir["llama_target"])  # 3 blocks: hidden_states has 4 entries, [-2] is after block 2
    assert lm.resolve_layer(-2) == 2 and lm.resolve_layer(-3) == 1 and lm.resolve_layer(3) == 3
    ids = [3, 4, 5, 6]
    lm.reset()
    _, hidden = lm.forward(ids, keep_logits=2, hidden_layer=-2)
    out = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(hidden, out.hidden_states[-2][0, -2:], atol=1e-5, rtol=1e-4)  # rounding: fused layers
    for bad in (0, 4, -4):
        with pytest.raises(UsageError, match="outside 1..3"):
            lm.resolve_layer(bad)


def test_model_inputs_read_d_at_its_own_row_and_p_at_the_predicting_row():
    """Rows of a verification forward over [last, d_1, d_2]: d_i's hidden state is row i, its p and entropy
    come from row i - 1."""
    hidden = torch.arange(3.0)[:, None].expand(3, 4)  # row r is filled with r
    probs = torch.tensor([[0.7, 0.1, 0.2], [0.2, 0.2, 0.6], [0.5, 0.5, 0.0]])
    h, s = clf.model_inputs("extended_v2", hidden, probs, torch.tensor([1, 2]))
    assert h[:, 0].tolist() == [1.0, 2.0]
    torch.testing.assert_close(s[:, 1], torch.tensor([0.1, 0.6]))
    calls = []
    clf.model_inputs("extended_v2", hidden, probs, torch.tensor([1, 2]), lambda: calls.append(1))
    assert not calls  # draft distributions are built only for types that read them
    q = torch.tensor([[0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    _, s4 = clf.model_inputs("extended", hidden, probs, torch.tensor([1, 2]), lambda: q)
    torch.testing.assert_close(s4[:, 3], torch.tensor([0.8, 0.4]))


def test_labels_stats_measures_how_well_p_d_alone_separates_pivots(trained, tiny_dir, tmp_path, capsys):
    """Parity labels: p(d) knows nothing of them (AUROC near 0.5), and the classifier is scored on the very
    report split its training reported on; labels made from p(d) itself: the p(d) reference separates them."""
    from pivotspec.classifier.training import probability_properties

    target, labels, clf_dir, config = trained
    parity = probability_properties(labels, target, clf_dir)
    assert parity["classifier_trained_on_this_file"]
    assert parity["report_auroc_classifier"] == pytest.approx(config["metrics"]["report"]["auroc"], abs=1e-6)
    assert parity["report_auroc_p_d"] == pytest.approx(config["references"]["logreg_p"]["report"]["auroc"], abs=1e-6)
    assert abs(parity["report_auroc_p_d"] - 0.5) < 0.3
    p_d = features.extract(target, [json.loads(x) for x in labels.read_text().splitlines()], 2)["scalars"][:, 1]
    cut = float(p_d.median())
    rows = [json.loads(x) for x in labels.read_text().splitlines()]
    for r, p in zip(rows, p_d.tolist(), strict=True):
        r["label"] = int(p < cut)
    by_p = tmp_path / "by_p.jsonl"
    by_p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    props = probability_properties(by_p, target, threshold=cut)
    assert props["report_auroc_p_d"] > 0.99
    assert props["harmless_low_p"] == 0.0 and props["pivots_high_p"] == 0.0
    assert main(["labels", "stats", str(labels), "--target", str(tiny_dir["llama_target"]), "--classifier",
                 str(clf_dir)]) == 0
    out = capsys.readouterr().out
    assert "among non-pivots" in out and "AUROC: p(d) only" in out and "classifier" in out
    assert main(["labels", "stats", str(labels), "--classifier", str(clf_dir)]) == 2
    assert "needs the target" in capsys.readouterr().err


def test_a_labels_file_kept_compressed_is_read_as_the_plain_one(trained, tmp_path, capsys):
    """Labels kept in the repository as ``X.jsonl.gz`` (so the tracked tree fits a device call) are found,
    hashed, scored and merged under the plain name: the hash is the plain content's, so a classifier trained on
    the plain file still knows the compressed one as its own."""
    import gzip

    from pivotspec.api import check_train_classifier, merge_labels
    from pivotspec.classifier.training import probability_properties

    target, labels, clf_dir, _ = trained
    kept = tmp_path / "labels.jsonl"
    (tmp_path / "labels.jsonl.gz").write_bytes(gzip.compress(labels.read_bytes()))
    assert not kept.exists()
    assert features.file_hash(kept) == features.file_hash(labels)
    assert probability_properties(kept, target, clf_dir)["classifier_trained_on_this_file"]
    check_train_classifier([kept], tmp_path / "clf")
    assert main(["labels", "stats", str(kept)]) == 0
    assert "candidates" in capsys.readouterr().out
    merged = merge_labels(tmp_path / "merged.jsonl", [kept])
    assert (tmp_path / "merged.jsonl").read_bytes() == labels.read_bytes() and merged["candidates"] > 0


def test_training_on_the_union_of_two_rounds(tiny_dir, tmp_path, capsys):
    """Two labels files (rounds) whose problems and steps coincide: every candidate of both is kept, and a
    problem's candidates from both rounds fall in one split (15 problems, not 30)."""
    a, b = fake_labels(tmp_path / "round0.jsonl", seed=0), fake_labels(tmp_path / "round1.jsonl", seed=1)
    assert main(["train-classifier", "--target", str(tiny_dir["llama_target"]), "--labels", str(a), str(b),
                 "--out", str(tmp_path / "clf"), "--layer", "2", "--epochs", "50"]) == 0
    config = json.loads((tmp_path / "clf" / "classifier.json").read_text())
    labels = config["labels"]
    assert labels["files"] == ["round0.jsonl", "round1.jsonl"] and len(labels["sha256_16"]) == 2
    assert labels["candidates"] == 2 * 15 * 8 and sum(labels["rows"].values()) == 240
    assert sum(labels["problems"].values()) == 15
    assert config["split"] == "by_round"


def test_a_union_of_rounds_keeps_round0s_split_and_splits_new_problems_among_themselves():
    g0 = torch.arange(20).repeat_interleave(3)  # round 0: problems 0-19, 3 rows each
    g1 = torch.arange(10, 35).repeat_interleave(2)  # round 1: 10-19 again, and 15 new problems
    groups, rounds = torch.cat([g0, g1]), torch.cat([torch.zeros_like(g0), torch.ones_like(g1)])
    split = features.split_by_round(groups, rounds, seed=3)
    assert torch.equal(split[rounds == 0], features.split_by_problem(g0, seed=3))  # as round 0 alone
    new = groups >= 20
    assert torch.equal(split[new], features.split_by_problem(groups[new], seed=3))
    assert all(len(torch.unique(split[groups == g])) == 1 for g in torch.unique(groups))  # one split a problem
    # what a permutation over the union's problems does instead: round 0's problems move
    assert not torch.equal(features.split_by_problem(groups, seed=3)[rounds == 0], split[rounds == 0])


def test_cached_features_are_per_dtype(tiny_dir, tmp_path, monkeypatch):
    """A bfloat16 target's features are computed in bfloat16, never read back from float32's cache."""
    from pivotspec.decoding.models import load_lm

    monkeypatch.setenv("PIVOTSPEC_CACHE", str(tmp_path / "cache"))
    labels = fake_labels(tmp_path / "labels.jsonl", n_problems=2)
    records = [json.loads(line) for line in labels.read_text().splitlines()]
    f32 = features.extract(load_lm(str(tiny_dir["llama_target"]), dtype="float32"), records, 2, cache_key="k")
    bf16 = features.extract(load_lm(str(tiny_dir["llama_target"]), dtype="bfloat16"), records, 2, cache_key="k")
    assert len(list((tmp_path / "cache" / "features").iterdir())) == 2
    assert not torch.equal(f32["hidden"], bf16["hidden"])
    assert f32["hidden"].shape == bf16["hidden"].shape
    again = features.extract(load_lm(str(tiny_dir["llama_target"]), dtype="float32"), records, 2, cache_key="k")
    assert torch.equal(again["hidden"], f32["hidden"])
    from pivotspec.decoding import rowwise

    if rowwise.available():  # the suite's bfloat16 ran on the row-wise kernel (conftest); PyTorch's is another
        monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "plain")
        plain = features.extract(load_lm(str(tiny_dir["llama_target"]), dtype="bfloat16"), records, 2, cache_key="k")
        assert len(list((tmp_path / "cache" / "features").iterdir())) == 3
        assert not torch.equal(plain["hidden"], bf16["hidden"])


def test_a_pivot_rule_relabels_candidates_from_their_stored_utilities(tiny_dir, tmp_path, capsys):
    """``--pivot-rule mul:0.8`` turns a moderate drop (0.9 -> 0.6), a non-pivot under the files' mul 0.5, into a
    pivot before the splits, the sweep and sigma see it; the rule is recorded, and a bad one is a one-line error."""
    from pivotspec.classifier.training import Filters
    from pivotspec.errors import UsageError

    feats = {"u_acc": torch.tensor([0.1, 0.6, 0.9]), "u_rej": torch.tensor([0.9, 0.9, 0.9]),
             "labels": torch.tensor([1, 0, 0])}
    assert Filters().relabel(feats)["labels"].tolist() == [1, 0, 0]
    assert Filters(pivot_rule="mul:0.8").relabel(feats)["labels"].tolist() == [1, 1, 0]
    assert Filters(pivot_rule="add:0.2").relabel(feats)["labels"].tolist() == [1, 1, 0]
    for bad in ("mul", "mul:2", "half:0.5"):
        with pytest.raises(UsageError, match="MODE:ALPHA"):
            Filters(pivot_rule=bad)
    labels = fake_labels(tmp_path / "labels.jsonl")
    rows = [json.loads(line) for line in labels.read_text().splitlines()]
    for r in rows:  # some non-pivots (d 3 or 21) lose a third of the success rate
        if not r["label"] and r["d"] % 9 == 3:
            r["u_acc"] = 0.6
    labels.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pivots = {}
    for rule in (None, "mul:0.8"):
        out = tmp_path / f"clf-{rule}"
        extra = ["--pivot-rule", rule] if rule else []
        assert main(["train-classifier", "--target", str(tiny_dir["llama_target"]), "--labels", str(labels),
                     "--out", str(out), "--layer", "2", "--epochs", "30", *extra]) == 0
        config = json.loads((out / "classifier.json").read_text())
        assert config["filters"]["pivot_rule"] == rule
        m = config["metrics"]
        pivots[rule] = sum(m[s]["pivots"] for s in ("report", "selection"))
    moderate = sum(1 for r in rows if not r["label"] and r["d"] % 9 == 3)
    assert moderate and pivots["mul:0.8"] > pivots[None]
    capsys.readouterr()
    assert main(["train-classifier", "--target", str(tiny_dir["llama_target"]), "--labels", str(labels),
                 "--out", str(tmp_path / "bad"), "--pivot-rule", "mul:0"]) == 2
    assert "--pivot-rule 'mul:0'" in capsys.readouterr().err and not (tmp_path / "bad").exists()
