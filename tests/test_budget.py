"""PAD with a per-answer budget for harm (issue 30): exact SD at budget 0, never spends more than it has,
stops at the first override it cannot pay, one budget per answer (batched rows included), and the drop head
that prices overrides is trained, stored and required."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pivotspec.classifier import drop
from pivotspec.classifier import model as clf
from pivotspec.cli.main import main
from pivotspec.decoding.acceptance import PAD, Budget, Verification, constant_classifier
from pivotspec.decoding.batch import Request, decode_many
from pivotspec.decoding.loop import decode
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.errors import UsageError
from pivotspec.evaluation.runs import method_specs
from pivotspec.policies import make_policy
from tests.test_batch import hidden_classifier
from tests.test_classifier import synthetic, trained  # noqa: F401  (trained: the module-scoped classifier)
from tests.test_decoding import prompts


@pytest.fixture(params=["llama", "qwen3"])
def pair(request, tiny_dir, load):
    return load(tiny_dir[f"{request.param}_target"]), load(tiny_dir[f"{request.param}_draft"])


def verification(sd_ok: list[bool]) -> Verification:
    """Greedy verification of len(sd_ok) draft tokens whose lossless verdicts are ``sd_ok``."""
    g, vocab = len(sd_ok), 8
    drafts = torch.tensor([2 + i for i in range(g)])
    logits = torch.zeros(g + 1, vocab)
    for i, ok in enumerate(sd_ok):
        logits[i, drafts[i] if ok else 7] = 5.0  # the target's argmax is the draft, or another token
        logits[i, drafts[i]] += 1.0  # rejected drafts still get some probability (above any floor used here)
    return Verification(drafts, logits, torch.zeros(g, vocab), SamplingConfig())


def priced(*prices: float):
    return lambda v: torch.tensor(prices)


def test_overrides_are_paid_in_draft_order_and_the_first_unpaid_one_ends_the_step():
    v = verification([False, True, False, False])
    budget = Budget(priced(0.2, 0.9, 0.5, 0.1), budget=0.6, p_floor=0.0).for_answer()
    # d1 costs 0.2; d2 was accepted by SD and is not charged; d3 (0.5) would make 0.7 > 0.6: the step's
    # overrides end there, though d4 (0.1) would fit, because nothing after a rejected draft is emitted.
    assert budget.override(v).tolist() == [True, False, False, False]
    assert budget.spent == pytest.approx(0.2)
    # the next step spends what is left: 0.2 more, then 0.9 is too much
    assert budget.override(verification([False, False])).tolist() == [True, False]
    assert budget.spent == pytest.approx(0.4)
    # and a sum that meets the budget exactly is paid, float rounding (0.2 + 0.2 + 0.1 + 0.1 > 0.6) aside
    budget.drop = priced(0.1, 0.1, 0.1)
    assert budget.override(verification([False, False, False])).tolist() == [True, True, False]
    assert budget.spent == pytest.approx(0.6)


def test_the_floor_still_applies_and_a_budget_is_checked():
    v = verification([False])
    assert Budget(priced(0.0), budget=1.0, p_floor=0.99).override(v).tolist() == [False]
    with pytest.raises(UsageError, match="budget must be >= 0"):
        Budget(priced(0.0), budget=-0.1)
    with pytest.raises(UsageError, match="needs both"):
        Budget(priced(0.0), budget=1.0, sigma=0.3)


def test_with_sigma_an_override_must_also_pass_the_per_token_rule():
    v = verification([False, False, False])
    scores = lambda v: torch.tensor([0.1, 0.6, 0.1])  # noqa: E731  (pivot scores: d2 looks like a pivot)
    inside = Budget(priced(0.01, 0.01, 0.01), budget=5.0, p_floor=0.0, pivot=scores, sigma=0.5).for_answer()
    assert inside.override(v).tolist() == [True, False, False]  # d2 fails sigma: the step's overrides end
    assert inside.spent == pytest.approx(0.01)
    alone = Budget(priced(0.01, 0.01, 0.01), budget=5.0, p_floor=0.0).for_answer()
    assert alone.override(v).tolist() == [True, True, True]  # the budget alone pays for the likely pivot too
    policy = make_policy("pad", None, classifier="const:0.3", sigma=0.2, budget=1.0)
    assert policy.sigma == 0.2 and policy.override(v).tolist() == [False, False, False]  # 0.3 > 0.2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_budget_zero_is_exactly_sd(pair, temperature):
    target, draft = pair
    free = Budget(constant_classifier(0.0), budget=0.0, p_floor=0.0)  # overrides would cost nothing
    for i, ids in enumerate(prompts(6)):
        kw = dict(gamma=3, max_new_tokens=12 + i, eos_ids=set(), cfg=SamplingConfig(temperature), seed=i)
        sd = decode("sd", target, draft, ids, **kw)
        pb = decode("pad", target, draft, ids, free, **kw)
        assert pb.token_ids == sd.token_ids and pb.trace == sd.trace
        assert pb.stats["override"] == 0 and pb.stats["budget_spent"] == 0


def test_a_budget_keeps_what_keep_all_keeps_until_it_runs_out(pair):
    """Price 0.3 per override and budget 1.0: the answer follows PAD-keeps-everything up to its fourth
    override, where the target's token comes instead, and spends 0.9."""
    target, draft = pair
    keep_all = PAD(constant_classifier(0.0), sigma=1.0, p_floor=0.0)
    budget = Budget(constant_classifier(0.3), budget=1.0, p_floor=0.0)
    checked = 0
    for ids in prompts(10, seed=3):
        kw = dict(gamma=4, max_new_tokens=40, eos_ids=set())
        every = decode("pad", target, draft, ids, keep_all, **kw)
        paid = decode("pad", target, draft, ids, budget, **kw)
        sources = [s for _, s in every.trace]
        if sources.count("override") < 4:
            continue
        fourth = [i for i, s in enumerate(sources) if s == "override"][3]
        assert paid.token_ids[:fourth] == every.token_ids[:fourth]
        assert paid.trace[fourth][1] == "corrected" and paid.token_ids[fourth] != every.token_ids[fourth]
        assert paid.stats["override"] == 3 and paid.stats["budget_spent"] == pytest.approx(0.9)
        checked += 1
    assert checked >= 3
    assert budget.spent == 0  # the policy given to decode is a template: each answer spends its own copy


def test_batched_rows_sharing_one_budget_policy_each_spend_their_own(pair):
    target, draft = pair
    shared = Budget(hidden_classifier, budget=1.5, p_floor=0.0, hidden_layer=-1)  # prices vary per token
    requests = [Request(ids, policy=shared, gamma=3, max_new_tokens=10 + 2 * i) for i, ids in enumerate(prompts(6))]
    outs = decode_many(target, requests, draft=draft, max_batch=4)
    overrides = 0
    for r, out in zip(requests, outs, strict=True):
        ref = decode("pad", target, draft, r.prompt_ids, shared, gamma=3, max_new_tokens=r.max_new_tokens,
                     eos_ids=r.eos_ids)
        assert out.token_ids == ref.token_ids and out.trace == ref.trace
        # prices read hidden states, which batched forwards give to the last bits only
        assert out.stats["budget_spent"] == pytest.approx(ref.stats["budget_spent"], abs=1e-3)
        assert out.stats["budget_spent"] <= 1.5
        overrides += out.stats["override"]
    assert overrides > 0 and shared.spent == 0


def test_the_drop_head_learns_the_size_of_a_drop():
    """Synthetic rows: pivots drop the utility by 0.6 to 0.9 (more the further along the pivot direction),
    others by 0 to 0.1. The head must rank pivots and beat predicting the mean."""
    h_all, s_all, y_all = synthetic(900, 32, 0)
    g = torch.Generator().manual_seed(1)
    size = torch.where(y_all == 1, 0.6 + 0.3 * torch.rand(900, generator=g), 0.1 * torch.rand(900, generator=g))
    tr, va = slice(0, 600), slice(600, None)
    net, info = drop.train_drop("extended_v2", (h_all[tr], s_all[tr]), size[tr], (h_all[va], s_all[va]), size[va],
                                lr=1e-3, weight_decay=1e-2, epochs=300, seed=0)
    pred = drop.predicted_drops(net, h_all[va], s_all[va])
    rep = drop.report(pred, size[va], y_all[va], float(size[tr].mean()))
    assert rep["pivot_auroc"] > 0.95 and rep["mse"] < 0.25 * rep["mse_train_mean"] and rep["pearson"] > 0.9
    assert abs(rep["mean_predicted"] - rep["mean_drop"]) < 0.05  # calibrated on average, not just ranked


def test_train_classifier_stores_a_drop_head_the_budget_reads(trained):  # noqa: F811
    target, _, out, config = trained
    assert (out / drop.WEIGHTS).is_file()
    assert config["drop"]["target"] == "max(0, u_rej - u_acc)"
    assert set(config["drop"]["report"]) >= {"mse", "mse_train_mean", "pearson", "pivot_auroc"}
    assert config["drop"]["lr"] == config["training"]["sweep"]["chosen"]["lr"]  # the sweep's choice, not a new one
    policy = make_policy("pad", target, classifier=str(out), budget=0.5)
    assert isinstance(policy, Budget) and policy.hidden_layer == config["layer"] and policy.budget == 0.5
    # the policy prices a verification step with the stored head, on the classifier's own inputs
    net = drop.load(out, config)
    v = Verification(torch.tensor([3, 4]), torch.randn(3, target.vocab_size), torch.randn(2, target.vocab_size),
                     SamplingConfig(), hidden=torch.randn(3, target.d_model))
    h, s = clf.model_inputs(net.kind, v.hidden, v.p_raw, v.draft_tokens, lambda: v.q_raw)
    torch.testing.assert_close(policy.drop(v), drop.predicted_drops(net, h, s), atol=0, rtol=0)


def test_a_classifier_without_a_drop_head_is_a_one_line_error(trained, tiny_dir, tmp_path, capsys):  # noqa: F811
    old = shutil.copytree(trained[2], tmp_path / "old")
    (old / drop.WEIGHTS).unlink()  # as trained before the drop head existed
    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    base = ["generate", "--target", t, "--draft", d, "--method", "pad", "--classifier", str(old), "--prompt", "w1"]
    assert main([*base, "--budget", "0.5"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no drop head" in err and "train it again" in err
    assert main([*base, "--max-new-tokens", "4"]) == 0  # per-token PAD does not need it
    capsys.readouterr()
    assert main([*base, "--budget", "0.5", "--sigma", "0.3"]) == 2  # sigma inside a budget needs the head too
    assert "no drop head" in capsys.readouterr().err
    net, config = clf.load(old)
    assert "drop" in config  # the config block alone is not enough: the weights are what price a token


def test_eval_runs_one_pad_budget_per_budget(tiny_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}", "regex": "w1"}) + "\n" for i in range(2, 5)))
    out = tmp_path / "run"
    assert main(["eval", "--target", str(tiny_dir["llama_target"]), "--draft", str(tiny_dir["llama_draft"]),
                 "--task", "jsonl", "--data", str(data), "--n", "3", "--methods", "sd,pad", "--classifier",
                 "const:0.25", "--budgets", "0,0.5", "--max-new-tokens", "10", "--gamma", "3", "--out", str(out),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["methods"]
    assert list(summary) == ["sd", "pad-budget@0", "pad-budget@0.5"]
    both = [s.label for s in method_specs("pad", classifier="const:0.25", sigmas=[0.2, 0.3], budgets=[0.5])]
    assert both == ["pad@0.2 budget=0.5", "pad@0.3 budget=0.5"]  # one per (sigma, budget)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    spent = [r["stats"]["budget_spent"] for r in rows if r["method"] == "pad-budget@0.5"]
    assert len(spent) == 3 and all(s <= 0.5 and s * 4 == round(s * 4) for s in spent)  # whole 0.25s
