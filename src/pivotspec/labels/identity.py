"""What a labels file, a classifier or a run was made with, and when two of those are the same: the model's
identity (name, shape, a fingerprint of its weights, the dtype it computed in, and the row-wise kernel where
that changes its numbers), and the fields a labels file holds one of. Resuming a labels file needs the same
run (:func:`same_run`); training a classifier from labels needs only the same weights (:func:`same_model`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pivotspec.decoding.models import LM

IDENTITY = ("task", "config", "target", "draft", "judge")  # what a labels file is made with: one per file


def model_identity(lm: LM) -> dict:
    """What a label or a classifier was made with: the model's name, shape, a fingerprint of its weights (a
    retrained model keeps its name and shape) and the dtype it computed in."""
    identity = {"name": lm.name, "num_layers": lm.num_layers, "d_model": lm.d_model, "vocab_size": lm.vocab_size,
                "weights": lm.weights_fingerprint, "dtype": lm.weights_dtype}
    if lm.placement.endswith(" rowwise"):  # int8 or bfloat16 on the row-wise kernel: its own numbers (LM.placement)
        identity["kernel"] = "rowwise"
    return identity


def same_model(a: dict | None, b: dict | None) -> bool:
    """Two model identities name the same weights: they agree on every field both have, the dtype aside
    (labels made in float32 train a classifier for the same model in bfloat16). Files written before a field
    existed (such as "weights") still match on the rest."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a == b
    return all(a[k] == b[k] for k in (a.keys() & b.keys()) - {"dtype"})


def same_run(a: dict | None, b: dict | None) -> bool:
    """The same weights computing in the same dtype, on the same kind of kernel where that changes the numbers
    (int8 and bfloat16 on the row-wise kernel): what resuming a labels file needs, since rollouts computed
    otherwise sample other tokens. Files from before the dtype was recorded were all float32."""
    return same_model(a, b) and computed_in(a) == computed_in(b)


def computed_in(m: dict | None) -> str | None:
    """A model identity's dtype, with " rowwise" for int8 or bfloat16 on the row-wise kernel."""
    if not isinstance(m, dict):
        return None
    return m.get("dtype", "float32") + (" rowwise" if m.get("kernel") == "rowwise" else "")


def identity_diff(a: dict, b: dict) -> list[str]:
    """The ``IDENTITY`` fields on which two labels records (or a record and a run) differ; a model that
    differs only in dtype is named with both (``a``'s first), since ``--dtype`` is then the fix."""
    def named(k: str) -> str | None:
        if k not in ("target", "draft"):
            return None if a.get(k) == b.get(k) else k
        if same_run(a.get(k), b.get(k)):
            return None
        if same_model(a.get(k), b.get(k)):
            there, here = computed_in(a[k]), computed_in(b[k])
            fix = f"--dtype {a[k].get('dtype', 'float32')}"
            if a[k].get("kernel") != b[k].get("kernel"):
                fix += f" with PIVOTSPEC_CPU_KERNELS={a[k].get('kernel', 'packed')}"
            return f"{k} dtype ({there} there, {here} here: {fix} matches it)"
        return k

    return sorted(n for n in map(named, IDENTITY) if n)
