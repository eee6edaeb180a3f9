"""The structure ARCHITECTURE.md promises, checked on the source: module sizes, no import cycle inside
petra_ds, no private attribute of another module read outside it, the harness out of the package."""

import ast
import os

import pytest

from subprocess_env import ROOT

PACKAGE = os.path.join(ROOT, "petra_ds")
#: private names of other projects that petra_ds extends, each for a reason no public API serves:
THIRD_PARTY = {
    "_INSTRUCTION_MAP": "DeepSpeed's extension point for pipeline instructions (its DualPipeV merges it too)",
    "_exec_schedule": "DeepSpeed PipelineEngine's schedule loop, overridden by a subclass to observe 1F1B",
    "_layer_specs": "DeepSpeed PipelineModule's layer specs: no public accessor, needed to partition stages",
    "_local_start": "DeepSpeed PipelineModule's first local layer index: no public accessor",
    "_BatchNorm": "torch's common base class of the batch norms",
    "_tokenizer": "the tokenizers.Tokenizer inside a trained ByteLevelBPETokenizer, for PreTrainedTokenizerFast",
    "_grid": "deepspeed.runtime.pipe.p2p's module-level grid of the last PipelineEngine: shutdown lets go of it so "
             "that its process groups end before the interpreter's teardown (DeepSpeed has no reset)",
    "_dynamo": "torch._dynamo.config.disable: DeepSpeed's Muon kernel runs eagerly on CPU instead of a torch.compile "
               "build (the only switch besides TORCHDYNAMO_DISABLE before torch is imported)",
}


def python_files(*tops: str) -> list[str]:
    out = []
    for top in tops:
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(out)


def module_name(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def petra_imports(path: str, modules: set[str]) -> set[str]:
    """The petra_ds modules ``path`` imports, at module level or inside functions."""
    name = module_name(path)
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in modules and m not in (name, "petra_ds")}


def test_no_import_cycle_inside_the_package():
    paths = python_files("petra_ds")
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): petra_imports(p, modules) for p in paths}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [node, dep]))
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert graph["petra_ds.engine"], "the import graph was not read"


def test_module_sizes():
    sizes = {os.path.relpath(p, ROOT): sum(1 for _ in open(p)) for p in python_files("petra_ds")}
    assert sizes["petra_ds/engine.py"] <= 450
    assert {path: n for path, n in sizes.items() if n > 500} == {}


def test_no_private_attribute_of_another_object_is_read():
    """``x._name`` only on ``self`` / ``cls`` / ``super()``, or on the third-party names above."""
    hits = []
    for path in python_files("petra_ds", "benchmarks", "examples", "tests"):
        for node in ast.walk(ast.parse(open(path).read())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            if node.attr not in THIRD_PARTY:
                hits.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert hits == []


def test_the_package_carries_no_fault_injection():
    """The test harness (SIGKILL, torn saves, patched os.replace) lives under tests/, not in petra_ds."""
    words = ("SIGKILL", "os.replace =", "kill_rank", "wrong_inverse", "nan_micro_batch")
    found = [(os.path.relpath(p, ROOT), w) for p in python_files("petra_ds") for w in words if w in open(p).read()]
    assert found == []
