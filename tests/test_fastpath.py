"""The CPU fast path: packed oneDNN linears (a row alone equals the row in a block), int8 linears, and the dtype
and kernels chosen by measurement and cached. Exactness of whole decodes within each dtype: ``test_exactness``."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from torch import nn

from pivotspec.decoding import fastpath, packing, rowwise
from pivotspec.decoding.fastpath import CpuPath, candidates, choose
from pivotspec.decoding.models import load_lm
from pivotspec.decoding.packing import PackedLinear, pack_linears

BF16 = fastpath.capabilities()["onednn_bf16"]
ROWWISE = {"float32 rowwise"} if rowwise.available() else set()  # where the C kernel builds
needs_bf16 = pytest.mark.skipif(not BF16, reason="oneDNN runs bfloat16 natively only on CPUs with AVX512-BF16/AMX")
DTYPES = ["float32", pytest.param("bfloat16", marks=needs_bf16)]
NO_CC = pytest.mark.skipif(not ROWWISE, reason="no C compiler for the kernel")


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_computes_the_plain_linear(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(getattr(torch, dtype))
    packed = PackedLinear(lin)
    x = torch.randn(2, 5, 64, dtype=lin.weight.dtype)
    with torch.inference_mode():
        ref, got = lin(x).float(), packed(x).float()
    assert got.shape == ref.shape
    # one rounding of the output apart at most: bfloat16 keeps 8 bits, float32 24
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    assert torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_equals_the_row_among_others(dtype):
    """What keeps greedy SD equal to the target alone: a 6-token verification gives each row the numbers the
    1-token decode step gives it (bit for bit in bfloat16, where a last-bit difference moves the output)."""
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False).to(getattr(torch, dtype)))
    x = torch.randn(6, 576, dtype=packed.weight.dtype)
    with torch.inference_mode():
        together = packed(x)
        alone = torch.cat([packed(x[i:i + 1]) for i in range(6)])
    if dtype == "bfloat16":
        assert torch.equal(together, alone)
    else:
        assert torch.allclose(together, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lone_row_widths_found_exact_are_exact_and_a_parting_width_is_refused(dtype, monkeypatch):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(576, 960, bias=False), nn.Linear(960, 576, bias=True)).to(getattr(torch, dtype))
    pack_linears(model)
    x = torch.randn(6, 576, dtype=model[0].weight.dtype)
    widths = packing.exact_lone_widths(model)
    assert set(widths) <= set(packing.LONE_WIDTHS)
    with torch.inference_mode():
        together = model(x)
        for width in widths:  # what the probe found exact is exact on other rows too
            packing.set_lone_rows(model, width)
            assert all(k.lone_rows == width for k in packing.packed_kernels(model))
            assert torch.equal(torch.cat([model(x[i:i + 1]) for i in range(6)]), together)
    real = packing.packed_linear

    def parting(flat, packed, bias, lone_rows=2, scales=None):  # a kernel that sums a lone row of width 1 otherwise
        out = real(flat, packed, bias, lone_rows, scales)
        return out + torch.ones_like(out) * (flat.shape[0] == 1 and lone_rows == 1)

    monkeypatch.setattr(packing, "packed_linear", parting)
    assert 1 not in packing.exact_lone_widths(model)


def test_choose_times_each_exact_lone_width_and_keeps_the_fastest(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "auto")  # the suite pins kernels (conftest)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir["llama_target"]).eval()
    lone_ms = {1: 3.0, 2: 5.0, 4: 1.0}  # 4 would be fastest, but it is not exact here

    def time_forwards(trial, **_kwargs):
        kernels = packing.packed_kernels(trial)
        return {"1_token_ms": lone_ms[kernels[0].lone_rows] if kernels else 100.0, "6_token_ms": 6.0}

    monkeypatch.setattr(fastpath, "time_forwards", time_forwards)
    monkeypatch.setattr(fastpath, "exact_lone_widths", lambda trial: [1, 2])
    monkeypatch.setattr(fastpath, "exact_row_limit", lambda trial: 40)
    store = tmp_path / "fastpath.json"
    path = choose(model, tiny_dir["llama_target"], store, dtype="float32")
    assert path == CpuPath("float32", True, lone_rows=1, max_rows=40)
    entry = next(iter(json.loads(store.read_text()).values()))
    assert entry["timings"]["float32 packed"]["lone_row_ms"] == {"1": 3.0, "2": 5.0}
    assert choose(model, tiny_dir["llama_target"], store, dtype="float32") == path  # from the cache
    fastpath.convert(model, path)
    assert {(k.lone_rows, k.max_rows) for k in packing.packed_kernels(model)} == {(1, 40)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_past_the_exact_limit_go_in_chunks_and_the_limit_is_where_blocks_part(dtype, monkeypatch):
    """A block of more rows than ``max_rows`` is computed in chunks of at most that many (oneDNN may sum a row
    of a large block otherwise: on an AMX Xeon from 150 rows), and ``exact_row_limit`` finds the first block size
    that parts: here a kernel made to part from 50 rows on."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=True)).to(getattr(torch, dtype))
    pack_linears(model)
    real = packing.packed_linear
    sizes = []

    def parting(flat, packed, bias, lone_rows=2, scales=None):
        sizes.append(flat.shape[0])
        out = real(flat, packed, bias, lone_rows, scales)
        return out + torch.ones_like(out) * (flat.shape[0] >= 50)

    monkeypatch.setattr(packing, "packed_linear", parting)
    assert packing.exact_row_limit(model, top=80) == 49
    packing.set_max_rows(model, 49)
    x = torch.randn(120, 64, dtype=model[0].weight.dtype)
    sizes.clear()
    with torch.inference_mode():
        whole = model(x)
        assert max(sizes) == 49  # 49 + 49 + 22 per layer
        assert torch.equal(whole, torch.cat([model(x[i:i + 6]) for i in range(0, 120, 6)]))
    monkeypatch.setattr(packing, "packed_linear", real)
    assert packing.exact_row_limit(model, top=80) == 80  # the real kernel on these shapes: no part up to 80


def test_packing_fuses_shared_inputs_keeps_weights_and_ties_and_computes_the_same(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    ids = torch.tensor([[3, 9, 4, 17, 5]])
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
    names = sorted(n for n, _ in model.named_parameters())
    assert pack_linears(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.model.layers[0].self_attn.k_proj, packing.FusedMember)
    assert isinstance(model.model.layers[0].mlp.up_proj, packing.FusedMember)
    assert sorted(n for n, _ in model.named_parameters()) == names  # fingerprints and state dicts unchanged
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        one = model(input_ids=ids[:, :1]).logits  # a lone row: the padded path
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(one, ref[:, :1], atol=1e-5, rtol=1e-5)


def test_candidates_follow_the_cpu_and_auto_weighs_bfloat16_only_with_its_instructions():
    plain = {"onednn_bf16": False, "avx512_bf16": False, "amx_bf16": False}
    emulated = {"onednn_bf16": True, "avx512_bf16": False, "amx_bf16": False}  # AVX-512 without BF16
    bf16 = {"onednn_bf16": True, "avx512_bf16": True, "amx_bf16": False, "rowwise_bf16": bool(ROWWISE)}
    amx = {"onednn_bf16": True, "avx512_bf16": False, "amx_bf16": True}
    float32 = {"float32", "float32 packed"} | ROWWISE
    bf16_rowwise = {"bfloat16 rowwise"} if ROWWISE else set()
    for caps, extra in ((bf16, bf16_rowwise), (amx, set())):
        assert {p.label for p in candidates(caps)} == float32 | {"bfloat16 packed"} | extra
        # a sliding window attends whole, not exact in bfloat16: auto keeps such a model in float32
        assert {p.label for p in candidates(caps, sliding=True)} == float32
        assert {p.label for p in candidates(caps, "float32")} == float32
    for caps in (plain, emulated):
        assert {p.label for p in candidates(caps)} == float32
    assert [p.label for p in candidates(bf16, "bfloat16")] == [*bf16_rowwise, "bfloat16", "bfloat16 packed"]
    # asked for bfloat16 on a CPU without the instructions: it gets it (the row-wise kernel emulating the dot
    # product, else PyTorch's emulation, unpacked), never float32
    assert [p.label for p in candidates(plain, "bfloat16")] == [*bf16_rowwise, "bfloat16"]


def test_choose_measures_once_keeps_the_fastest_and_reads_the_cache(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "auto")  # the suite pins kernels (conftest)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir["llama_target"]).eval()
    fake = {"float32": (3.0, 9.0), "float32 packed": (4.0, 6.0), "float32 rowwise": (4.0, 6.5), "bfloat16": (3.0, 8.0),
            "bfloat16 packed": (4.0, 4.0), "bfloat16 rowwise": (4.0, 4.5)}
    calls = []

    def measure(_model, paths, widths):
        calls.append([p.label for p in paths])
        assert widths == fastpath.LATENCY_WIDTHS
        return {p.label: {"1_token_ms": fake[p.label][0], "6_token_ms": fake[p.label][1]} for p in paths}

    monkeypatch.setattr(fastpath, "measure", measure)
    monkeypatch.setattr(fastpath, "capabilities", lambda: {"cpu": "test", "isa": "AVX512", "avx512_bf16": True,
                                                           "amx_bf16": False, "onednn_bf16": True,
                                                           "rowwise_bf16": bool(ROWWISE)})
    store = tmp_path / "fastpath.json"
    args = (model, tiny_dir["llama_target"], store)
    assert choose(*args, dtype="float32") == CpuPath("float32", True)  # least 1-token + 6-token time
    assert choose(*args, dtype="float32") == CpuPath("float32", True)
    assert len(calls) == 1  # the second answer came from the cache
    assert choose(*args, dtype="bfloat16") == CpuPath("bfloat16", True)
    assert len(calls) == 2
    # auto weighs float32 and packed bfloat16 together, and leaves float32 only to save a quarter of the time
    assert choose(*args) == CpuPath("float32", True)  # bfloat16 packed saves 20% here (8 ms against 10)
    assert calls[-1] == ["float32", "float32 packed", *ROWWISE, *({"bfloat16 rowwise"} if ROWWISE else ()),
                         "bfloat16 packed"]
    fake["bfloat16 packed"] = (3.0, 4.0)  # saves 30%: a new model key, measured again
    monkeypatch.setattr(fastpath, "model_key", lambda source: "another")
    assert choose(*args) == CpuPath("bfloat16", True)
    assert len(calls) == 4
    stale = json.loads(store.read_text())
    stale["gone"] = {"choice": {"dtype": "float32", "packed": False}, "model": str(tmp_path / "deleted")}
    store.write_text(json.dumps(stale))
    monkeypatch.setattr(fastpath, "model_key", lambda source: "a third")
    choose(*args)
    assert "gone" not in json.loads(store.read_text())  # a verdict whose model is gone is dropped on the next write
    assert len(calls) == 5
    monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "plain")  # pinned: no measurement
    assert choose(*args, dtype="bfloat16") == CpuPath("bfloat16", False)
    if ROWWISE:
        monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "rowwise")
        assert choose(*args, dtype="float32") == fastpath.ROWWISE
        fake["float32 rowwise"] = (3.0, 5.0)  # the fastest float32 path: chosen, exact at every width
        monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "auto")
        monkeypatch.setattr(fastpath, "model_key", lambda source: "a fourth")
        assert choose(*args, dtype="float32") == fastpath.ROWWISE
        assert len(calls) == 6
        calls.pop()
    assert len(calls) == 5
    entries = json.loads(store.read_text()).values()
    assert any(e["timings"].get("bfloat16 packed", {}).get("6_token_ms") == 4.0 for e in entries)
    chosen = [{k: e["choice"][k] for k in ("dtype", "packed", "lone_rows")} for e in entries]
    assert chosen.count({"dtype": "float32", "packed": True, "lone_rows": 2}) == 2


def test_a_server_chooses_by_its_full_batch_too(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "auto")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir["llama_target"]).eval()
    # a lone request's forwards favour float32 (row-wise where it builds); the 48-token batch, packed bfloat16
    fake = {"float32": (3.0, 6.0, 60.0), "float32 packed": (4.0, 6.0, 40.0), "float32 rowwise": (2.0, 4.0, 50.0),
            "bfloat16": (3.0, 6.0, 60.0), "bfloat16 packed": (3.0, 4.0, 10.0), "bfloat16 rowwise": (2.0, 4.0, 45.0)}
    seen = []

    def measure(_model, paths, widths):
        seen.append(widths)
        return {p.label: {f"{w}_token_ms": fake[p.label][i] for i, w in enumerate(widths)} for p in paths}

    monkeypatch.setattr(fastpath, "measure", measure)
    monkeypatch.setattr(fastpath, "capabilities", lambda: {"cpu": "test", "isa": "AVX512", "avx512_bf16": True,
                                                           "amx_bf16": True, "onednn_bf16": True,
                                                           "rowwise_bf16": bool(ROWWISE)})
    store = tmp_path / "fastpath.json"
    lone = choose(model, tiny_dir["llama_target"], store)
    assert lone.dtype == "float32"
    served = choose(model, tiny_dir["llama_target"], store, widths=fastpath.SERVING_WIDTHS)
    assert served == CpuPath("bfloat16", True)  # 17 ms (22.7 weighed) against float32 packed 50
    assert seen == [fastpath.LATENCY_WIDTHS, fastpath.SERVING_WIDTHS]  # two verdicts, each under its own key
    assert len(json.loads(store.read_text())) == 2
    assert choose(model, tiny_dir["llama_target"], store, widths=fastpath.SERVING_WIDTHS) == served
    assert len(seen) == 2  # read from the cache


def test_auto_takes_the_measured_path_and_labels_record_it(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "auto")  # the suite pins kernels (conftest)
    from pivotspec.labels.identity import model_identity, same_model, same_run

    monkeypatch.setenv("PIVOTSPEC_CACHE", str(tmp_path))
    lm = load_lm(str(tiny_dir["llama_draft"]), dtype="auto")
    entry = next(iter(json.loads((tmp_path / fastpath.CACHE_FILE).read_text()).values()))
    assert lm.weights_dtype == entry["choice"]["dtype"]  # a row-wise bfloat16 model holds float32 parameters
    assert packing.is_packed(lm.model) == entry["choice"]["packed"]
    other = load_lm(str(tiny_dir["llama_draft"]), dtype="float32" if entry["choice"]["dtype"] != "float32"
                    else "bfloat16")
    a, b = model_identity(lm), model_identity(other)
    assert a["dtype"] != b["dtype"]
    assert same_model(a, b)  # the same weights: labels made in one dtype train a classifier in the other
    assert not same_run(a, b)  # but a labels file does not resume in another dtype
    b = {k: v for k, v in b.items() if k != "kernel"}  # as PyTorch's kernels record it (below: the row-wise one)
    old = {k: v for k, v in b.items() if k != "dtype"}  # written before dtypes were recorded: all float32
    assert same_run(old, {**b, "dtype": "float32"}) and not same_run(old, {**b, "dtype": "bfloat16"})
    from pivotspec.labels.identity import identity_diff

    # the one-line refusal names the dtype and the fix, not just "a different target"
    assert identity_diff({"target": {**b, "dtype": "float32"}}, {"target": {**b, "dtype": "bfloat16"}}) == [
        "target dtype (float32 there, bfloat16 here: --dtype float32 matches it)"]
    assert identity_diff({"target": a}, {"target": {**a, "weights": "other"}}) == ["target"]
    # int8 and bfloat16 on the row-wise kernel compute other numbers than PyTorch's or oneDNN's: never resumed
    packed, rows = {**b, "dtype": "bfloat16"}, {**b, "dtype": "bfloat16", "kernel": "rowwise"}
    assert same_model(packed, rows) and not same_run(packed, rows) and same_run(rows, dict(rows))
    assert identity_diff({"target": packed}, {"target": rows}) == [
        "target dtype (bfloat16 there, bfloat16 rowwise here: --dtype bfloat16 with PIVOTSPEC_CPU_KERNELS=packed "
        "matches it)"]


INT8_KERNELS = ["int8", pytest.param("rowwise-int8", marks=NO_CC)]


def int8_linear(in_features: int, out_features: int, bias: bool = False,
                kernel: str = "int8") -> tuple[nn.Linear, PackedLinear]:
    torch.manual_seed(2)
    lin = nn.Linear(in_features, out_features, bias=bias)
    return lin, PackedLinear(lin, kernel)


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_int8_linear_computes_the_plain_linear_within_its_rounding(kernel):
    lin, packed = int8_linear(64, 96, bias=True, kernel=kernel)
    assert packed.scales is not None and packed.packed.dtype == torch.int8 and packed.weight is lin.weight
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        ref, got = lin(x), packed(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    # weights rounded to 1/254 of each row's largest (and PyTorch's kernel rounds the inputs to bfloat16's 8
    # bits): about 1% of the largest output at most
    err = (got - ref).abs().max() / ref.abs().max()
    assert 1e-5 < err < 3e-2  # not float32's numbers (it is quantized), and close to them
    if kernel == "rowwise-int8":  # the int8 weights times their scales on float32 inputs, to float32's rounding
        q = packed.packed.transpose(1, 2).reshape(-1, 64)[:96].float()
        assert torch.allclose(got, x @ (q * packed.scales[:, None]).T + lin.bias, atol=1e-5, rtol=1e-5)
        assert torch.equal(int8_linear(64, 96, bias=True)[1].scales.float(), packed.scales)  # PyTorch kernel's


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_int8_rows_are_computed_each_alone_at_any_block_size(kernel):
    """What keeps greedy SD equal to ar and batched rows equal to rows alone in int8: every row gets the same
    bits at any block size, and the fast path measures it (a lone row needs no padding, no row limit)."""
    _, packed = int8_linear(576, 1536, kernel=kernel)
    x = torch.randn(40, 576)
    with torch.inference_mode():
        alone = torch.cat([packed.product(x[i:i + 1]) for i in range(40)])
        for m in (2, 4, 5, 6, 17, 40):
            assert torch.equal(packed.product(x[:m]), alone[:m])
    model = nn.Sequential(nn.Linear(64, 32))
    pack_linears(model, kernel)
    assert packing.exact_lone_widths(model) == [1, 2, 4] and packing.exact_row_limit(model, top=64) == 64


def test_int8_refuses_input_widths_its_kernel_gets_wrong():
    from pivotspec.errors import UsageError

    model = nn.Sequential(nn.Linear(64, 12), nn.Linear(12, 8))
    with pytest.raises(UsageError, match="multiples of 8 .*has 12.*--dtype bfloat16 or float32"):
        pack_linears(model, "int8")
    assert type(model[0]) is nn.Linear  # refused before any layer was replaced
    if ROWWISE:  # the row-wise kernel takes any width
        pack_linears(model, "rowwise-int8")
        x = torch.randn(3, 64)
        with torch.inference_mode():
            assert model(x).shape == (3, 8)


def test_sliding_windows_are_told_apart():
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    assert fastpath.has_sliding_window(MistralConfig(sliding_window=4096))
    assert fastpath.has_sliding_window(Gemma2Config())  # every other layer slides (layer_types)
    assert not fastpath.has_sliding_window(MistralConfig(sliding_window=None))
    assert not fastpath.has_sliding_window(Qwen2Config())  # a window size, but use_sliding_window off
    assert fastpath.has_sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1))
    assert not fastpath.has_sliding_window(LlamaConfig())


def test_serve_loads_target_and_draft_by_the_serving_widths(tiny_dir, monkeypatch):
    import pivotspec.api as api
    cli = importlib.import_module("pivotspec.cli.main")  # the package exports its main() under that name

    seen = []
    real = fastpath.choose

    def spy(*args, **kwargs):
        seen.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(fastpath, "choose", spy)
    target, draft = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    api.load_pair(target, draft)
    assert seen == [fastpath.LATENCY_WIDTHS] * 2
    api.load_pair(target, draft, serving=True)
    assert seen[2:] == [fastpath.SERVING_WIDTHS] * 2

    class Loaded(Exception):
        pass

    def load_pair(args, needs_draft, serving=False):
        seen.append(("cli", serving))
        raise Loaded

    monkeypatch.setattr(cli, "load_pair", load_pair)
    with pytest.raises(Loaded):
        cli.cmd_serve(cli.build_parser().parse_args(["serve", "--target", target, "--draft", draft, "--method", "sd"]))
    assert seen[-1] == ("cli", True)  # the server chooses for its batch, whatever --max-batch
