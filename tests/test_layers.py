"""The house's shape: each module imports only from its own layer or the layers below, entry points (the
command line, the server, the benchmarks) only the API, and no import circle, top-level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
SRC = ROOT / "src" / "pivotspec"

# Lowest first. A module belongs to the layer of its longest listed prefix; every module must have one.
LAYERS = [
    ("base", ["pivotspec.errors", "pivotspec.store", "pivotspec.tasks"]),
    ("decoding core", ["pivotspec.decoding"]),
    ("embedded artifacts", ["pivotspec.testbed"]),
    ("labels", ["pivotspec.labels"]),
    ("classifier", ["pivotspec.classifier"]),
    ("integrations", ["pivotspec.integrations"]),
    ("policies", ["pivotspec.policies"]),
    ("evaluation", ["pivotspec.evaluation"]),
    ("api", ["pivotspec", "pivotspec.api", "pivotspec._moved"]),
    ("entry points", ["pivotspec.cli", "pivotspec.server"]),
]
# What an entry point may import of the library, besides the entry points (``pivotspec serve`` starts the server).
API = {"pivotspec", "pivotspec.api", "pivotspec.errors"}


def module_name(path: Path, root: Path, package: str) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join((package, *parts)).removesuffix(".__init__")


def imports(path: Path, known: set[str]) -> set[str]:
    """The pivotspec modules ``path`` imports anywhere in it."""
    return imports_in(path.read_text(), known)


def imports_in(source: str, known: set[str]) -> set[str]:
    """The pivotspec modules ``source`` imports anywhere in it (``from pivotspec import api`` is pivotspec.api)."""
    deps = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pivotspec":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                deps.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.split(".")[0] == "pivotspec")
    return deps


def library_graph() -> dict[str, set[str]]:
    files = {module_name(f, SRC, "pivotspec"): f for f in SRC.rglob("*.py")}
    return {mod: imports(f, set(files)) - {mod} for mod, f in files.items()}


def layer_of(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module.startswith(prefix + ".") and prefix != "pivotspec"  # the root module is itself only
            if (module == prefix or inside) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank)
    return None if best is None else best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path back to itself for every module that lies on a circle."""
    found = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    found.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = [f"{m}: in no layer (add it to LAYERS)" for m in graph if layer_of(m) is None]
    entry = layer_of("pivotspec.cli")
    for mod, deps in graph.items():
        for dep in deps:
            if dep not in graph:
                out.append(f"{mod} imports {dep}, which does not exist")
            elif layer_of(dep) > layer_of(mod):
                out.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) imports upward: {dep} ({LAYERS[layer_of(dep)][0]})")
            elif layer_of(mod) == entry and dep not in API and layer_of(dep) != entry:
                out.append(f"entry point {mod} goes around the API: imports {dep}")
    out += [f"circle: {' -> '.join(c)}" for c in cycles(graph)]
    return out


def test_the_checks_catch_an_upward_import_a_bypass_and_a_circle():
    graph = {"pivotspec.errors": set(), "pivotspec.decoding.loop": {"pivotspec.api"},
             "pivotspec.api": {"pivotspec.decoding.loop", "pivotspec.errors"},
             "pivotspec.cli.main": {"pivotspec.api", "pivotspec.decoding.loop"}, "pivotspec.extra": set()}
    found = violations(graph)
    assert any("imports upward: pivotspec.api" in v for v in found)
    assert any("goes around the API: imports pivotspec.decoding.loop" in v for v in found)
    assert any(v.startswith("circle: pivotspec.decoding.loop -> pivotspec.api") for v in found)
    assert any("pivotspec.extra: in no layer" in v for v in found)
    assert imports_in("def f():\n    from pivotspec import api", {"pivotspec.api"}) == {"pivotspec.api"}


def test_the_library_has_layers_one_way_in_and_no_circle():
    graph = library_graph()
    assert len(graph) > 40  # the walk found the package
    assert violations(graph) == []


# Component studies measure one room of the house, not the product, so they may enter it: each with what it
# measures. Every other benchmark measures what a user runs and calls the API (and the server) only.
COMPONENT_STUDIES = {
    "testbed.py": ("the embedded pair's models: single forwards, teacher-forced agreement, batched HF greedy",
                   {"pivotspec.decoding", "pivotspec.tasks", "pivotspec.testbed", "pivotspec.evaluation.summary"}),
    "labeling_speed.py": ("the rollout engine alone: batched against one prefix at a time",
                          {"pivotspec.decoding", "pivotspec.labels", "pivotspec.tasks"}),
    "cpu_forwards.py": ("the CPU kernels themselves: forwards per dtype and packing, llama.cpp beside them",
                        {"pivotspec.decoding.fastpath", "pivotspec.decoding.packing", "pivotspec.decoding.forward",
                         "pivotspec.decoding.models", "pivotspec.decoding.rowwise"}),
    "classifier_cv.py": ("the classifier's training internals: out-of-fold AUROC per layer and type",
                         {"pivotspec.classifier", "pivotspec.cli.classifier", "pivotspec.decoding.models",
                          "pivotspec.evaluation.reports"}),
    "row_scaling.py": ("one forward of each model as rows are added: what a batched step costs against one row's",
                       {"pivotspec.decoding.forward", "pivotspec.decoding.kvcache"}),
    "round_reports.py": ("the classifier's training splits: rounds' classifiers scored on round 0's held-out problems",
                         {"pivotspec.classifier"}),
    "label_shift.py": ("the labels files themselves: the same candidates' utilities under two rollout policies",
                       {"pivotspec.labels.walk", "pivotspec.classifier.training", "pivotspec.store"}),
    "attention_kernel.py": ("the per-query attention kernel itself: against an earlier build of it and PyTorch",
                            {"pivotspec.decoding.query_attention", "pivotspec.decoding.compiled",
                             "pivotspec.decoding.machine"}),
}


def test_benchmarks_call_the_api_only():
    known = set(library_graph())
    bypasses = []
    for f in sorted((ROOT / "benchmarks").glob("*.py")):
        allowed = COMPONENT_STUDIES.get(f.name, ("", set()))[1]
        for dep in imports(f, known):
            inside = any(dep == a or dep.startswith(a + ".") for a in allowed)
            if dep not in API and not dep.startswith("pivotspec.server") and not inside:
                bypasses.append(f"{f.name} imports {dep}")
    assert not bypasses, bypasses


def test_old_module_paths_still_import_and_name_the_new_one():
    import importlib
    import sys
    import warnings

    from pivotspec.decoding import acceptance, baselines

    for old, new in [("pivotspec.acceptance", acceptance), ("pivotspec.baselines", baselines)]:
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is new and any(new.__name__ in str(w.message) for w in caught)
    from pivotspec.baselines import make_baseline  # the README of 0.1 showed this import

    assert make_baseline is baselines.make_baseline
