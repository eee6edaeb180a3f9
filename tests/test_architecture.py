"""The structure ARCHITECTURE.md promises, checked on the source: the layers and which may import which, no
import cycle inside petra_ds, module sizes, no private attribute of another module read outside it, the
harness out of the package, one handler per instruction, and checkpoints from before the layers still load."""

import ast
import os
import re

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
    "_forward_hooks": "a torch module's forward hooks: whether user code can run in its forward (nn.draws keys a "
                      "branch's random stream unless nothing there can draw; torch has no public query)",
    "_forward_pre_hooks": "a torch module's forward pre-hooks, see _forward_hooks",
    "_modules": "a torch module's submodule slots: nn.draws walks a stage's modules once per window, and children() "
                "(a generator over a generator that keeps a set) was most of that walk's host time",
    "_global_forward_hooks": "torch's forward hooks registered for every module, see _forward_hooks",
    "_global_forward_pre_hooks": "torch's forward pre-hooks registered for every module, see _forward_hooks",
    "_foreach_abs": "torch's multi-tensor ops (what torch's own optimizers and clip_grad_norm_ use): one fused op "
                    "per list of tensors instead of one per tensor",
    "_foreach_max": "torch's multi-tensor maximum, see _foreach_abs",
    "_foreach_add_": "torch's multi-tensor add, see _foreach_abs (the op counter's test counts one)",
    "_foreach_mul_": "torch's multi-tensor multiply in place, see _foreach_abs (weight prediction, a test)",
    "_foreach_mul": "torch's multi-tensor multiply into new tensors, see _foreach_abs (weight prediction)",
    "_foreach_add": "torch's multi-tensor add into new tensors, see _foreach_abs (weight prediction)",
    "_foreach_sub": "torch's multi-tensor subtraction into new tensors, see _foreach_abs (weight prediction)",
    "_foreach_norm": "torch's multi-tensor norm, see _foreach_abs",
    "_foreach_copy_": "torch's multi-tensor copy, see _foreach_abs (a FIFO entry's storages to host memory and back)",
    "_inductor": "torch._inductor.config.fallback_random: compiled random ops draw as eager ones do, so keyed "
                 "RNG scopes give a compiled forward and reconstruction the same masks (no public switch)",
    "_profiler_enabled": "torch.autograd._profiler_enabled(): whether a torch.profiler is recording, so that the "
                         "engine labels each instruction only then (torch has no public query)",
    "_attn_implementation": "Hugging Face's config field naming the attention kernel: from_pretrained sets it on a "
                            "plain model's config, a config has no public setter",
    "_orig_mod": "torch.compile's wrapper of a module (OptimizedModule) holds it there: initialize names a compiled "
                 "PipelineModule as such and points to \"compile\": true",
    "_no_split_modules": "Hugging Face's per-model list whose first entry names its decoder layer class: the one "
                         "pointer from a causal LM class to its layer class",
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


def petra_imports(path: str, modules: set[str], at_run_time: bool = False) -> set[str]:
    """The petra_ds modules ``path`` imports, at module level or inside functions; ``at_run_time``: not
    those only a type checker reads (``if TYPE_CHECKING:``)."""
    name = module_name(path)
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    tree = ast.parse(open(path).read())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if at_run_time and id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in modules and m != name}


#: petra_ds's layers, lowest first. A module may import its own package and every layer below its own;
#: packages that share a layer are independent of each other. The package's top (``petra_ds/__init__.py``,
#: which holds ``initialize``) sees everything.
LAYERS = (
    ("util",),  # atomic files, nested-tensor walks, argument checks
    ("schedule", "nn", "data"),  # the schedule as data; the coupling math; data streams
    ("models",),  # RevNets, RevGPT, the Reformer adapter, HF decoders: layer specs built from nn; generation
    ("pipeline",),  # the PipelineModule: stages, ties, the partition
    ("runtime",),  # the engine and what it runs: stage, transport, checkpoint, optimizers, ...
    ("verify",),  # the instruction replay and the NCCL-rules replay
    ("perf",),  # the time model and the paper's memory estimate
    ("diagnostics",),  # observers: gradient quality, held bytes, the run's settings; per-rank memory
    ("tools",),  # run tooling: the examples' arguments and files, spawning processes, recipes
)


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, package) of a petra_ds module; the top is above every layer."""
    parts = module.split(".")
    package = parts[1] if len(parts) >= 2 else ""
    for index, packages in enumerate(LAYERS):
        if package in packages:
            return index, package
    return len(LAYERS), package


def import_graph(at_run_time: bool = False) -> dict[str, set[str]]:
    paths = python_files("petra_ds")
    modules = {module_name(p) for p in paths}
    return {module_name(p): petra_imports(p, modules, at_run_time) for p in paths}


def test_every_package_has_a_layer():
    packages = {name for name in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))}
    assert packages == {package for layer in LAYERS for package in layer}
    top = {name for name in os.listdir(PACKAGE) if name.endswith(".py")}
    assert top == {"__init__.py"}, "a module at the top of petra_ds belongs in a layer"


def test_no_import_runs_upward():
    """Function-level imports included: a lazy import is still a dependency."""
    upward = []
    for module, imported in sorted(import_graph().items()):
        level, package = layer_of(module)
        for target in sorted(imported):
            their_level, their_package = layer_of(target)
            if their_package != package and their_level >= level:
                upward.append(f"{module} -> {target}")
    assert upward == []
    assert import_graph()["petra_ds.runtime.engine"], "the import graph was not read"


def test_no_import_cycle_inside_the_package():
    graph = {module: {t for t in imported if t != "petra_ds"} for module, imported in import_graph(True).items()}
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
    assert graph["petra_ds.runtime.engine"], "the import graph was not read"


def test_module_sizes():
    sizes = {os.path.relpath(p, ROOT): sum(1 for _ in open(p)) for p in python_files("petra_ds")}
    assert sizes and {path: n for path, n in sizes.items() if n > 500} == {}


def test_files_are_written_through_the_atomic_writer():
    """No module of the package, the benchmarks or the examples opens a file for writing or saves a figure but
    ``util/files.py`` (whole or not at all); appending a line ("a") stays allowed."""
    writers = []
    for path in python_files("petra_ds") + python_files("benchmarks") + python_files("examples"):
        if path.endswith(os.path.join("util", "files.py")):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name) and node.func.id == "open":
                modes = list(node.args[1:2]) + [k.value for k in node.keywords if k.arg == "mode"]
                if any(isinstance(m, ast.Constant) and "w" in str(m.value) for m in modes):
                    writers.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("savefig", "write_text", "write_bytes"):
                writers.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert writers == []


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


def test_one_handler_per_instruction_and_no_other():
    """The engine runs exactly the schedule's instructions, each through one handler; no DeepSpeed
    handler is reachable and no two classes in its map share a name."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from petra_ds.runtime.engine import PetraEngine
    from petra_ds.schedule import INSTRUCTIONS

    handlers = PetraEngine._INSTRUCTION_MAP
    assert set(handlers) == set(INSTRUCTIONS)
    assert not set(handlers) & set(PipelineEngine._INSTRUCTION_MAP)
    names = [cls.__name__ for cls in handlers]
    assert len(names) == len(set(names))
    assert all(callable(handlers[cls]) for cls in INSTRUCTIONS)


def documented_clock_modules() -> tuple[int, set[str]]:
    """ARCHITECTURE.md's count of the modules one training window runs and the modules it names there."""
    text = open(os.path.join(ROOT, "ARCHITECTURE.md")).read()
    paragraph = text.split("**Modules a clock crosses.**")[1].split("\n\n")[0]
    count = int(re.search(r"code\s+in\s+(\d+)\s+petra_ds\s+modules", paragraph).group(1))
    names = {"petra_ds." + path.replace("/", ".") for path in re.findall(r"`([a-z_]+/[a-z_]+)\.py`", paragraph)
             if os.path.isdir(os.path.join(PACKAGE, path.split("/")[0]))}
    return count, names


@pytest.fixture(scope="module")
def one_window():
    """What a profiler sees on every rank of a two-rank pipeline whose middle stages reconstruct, during one
    training window once the pipeline is full (``probes.modules_a_window_runs``)."""
    from harness import launch

    results = launch({"pipe": 2, "stages_per_rank": 2, "train_batches": 3, "drain": False, "capture_grads": False,
                      "probe": "probes:modules_a_window_runs"})
    assert any(reconstructs for r in results for reconstructs in r["reconstructs"].values())
    return [r["probe"] for r in results]


def test_one_window_runs_the_modules_the_architecture_names(one_window):
    """The modules a training window runs once the pipeline is full (each stage's first-forward check of its
    layers is behind it) are the ones ARCHITECTURE.md lists, and as many as it says; the toy model's own layers
    (tools/toy.py, built on nn/coupling.py) come on top, as a user's model would."""
    ran = set().union(*(set(r["modules"]) for r in one_window)) - {"petra_ds.tools.toy", "petra_ds.nn.coupling"}
    count, listed = documented_clock_modules()
    assert ran == listed
    assert count == len(listed)


def documented_collaborators() -> tuple[int, set[str]]:
    """ARCHITECTURE.md's count of the engine's collaborators and the module (or package) of each."""
    text = open(os.path.join(ROOT, "ARCHITECTURE.md")).read()
    paragraph = text.split("**Who the engine talks to.**")[1].split("\n\n")[0]
    words = {"five": 5, "six": 6, "seven": 7}
    count = words[re.search(r"talks to (\w+) collaborators", paragraph).group(1)]
    return count, set(re.findall(r"`((?:schedule|runtime)/(?:[a-z_]+\.py)?)`", paragraph))


def collaborator_of(module: str) -> str:
    """``petra_ds.schedule.clock`` -> ``schedule/``; ``petra_ds.runtime.stage`` -> ``runtime/stage.py``."""
    parts = module.split(".")[1:]
    return parts[0] + "/" if parts[0] == "schedule" else "/".join(parts) + ".py"


def test_the_engine_talks_to_the_collaborators_the_architecture_names(one_window):
    """Whose code the engine's own code calls during a ``train_batch`` call, on every rank: at most six
    collaborators, the ones ARCHITECTURE.md names."""
    called = {collaborator_of(m) for r in one_window for m in r["engine_calls"]}
    count, named = documented_collaborators()
    assert count <= 6 and len(named) == count
    assert called == named


def test_every_message_instruction_names_its_channel_and_key():
    """Sends and receives carry their rule as data: a send and the receive that pairs with it agree."""
    from petra_ds.schedule import (RecvActivation, RecvGrad, RecvTiedGrad, RecvTiedWeight, SendActivation, SendGrad,
                                   SendTiedGrad, SendTiedWeight, channels)

    pairs = [(SendActivation(stage=2, micro_batch=5), RecvActivation(stage=3, micro_batch=5)),
             (SendActivation(stage=2, micro_batch=5, kind=channels.EVAL),
              RecvActivation(stage=3, micro_batch=5, kind=channels.EVAL)),
             (SendGrad(stage=3, micro_batch=5, with_input=True), RecvGrad(stage=2, micro_batch=5, with_input=True)),
             (SendTiedGrad(stage=4, owner=0, tie="embed", step=7), RecvTiedGrad(stage=0, reader=4, tie="embed", step=7)),
             (SendTiedWeight(stage=0, reader=4, tie="embed", step=7), RecvTiedWeight(stage=4, owner=0, tie="embed", step=7))]
    for send, recv in pairs:
        assert send.sends is True and recv.sends is False
        assert send.channel() == recv.channel() and send.key() == recv.key()
        assert send.key().stage == send.channel().dst == recv.stage
    assert SendGrad(stage=3, micro_batch=5, with_input=False).payload(("delta", "x")) == ("delta", None)


def test_a_checkpoint_written_before_the_layers_loads(tmp_path):
    """tests/fixtures/checkpoint_before_move: written by the code before the package was split into layers;
    today's code loads it and reaches, 2 steps later, the losses and parameters that code reached. Equal up to
    1e-6, not bitwise: the fixture was written on another CPU, whose float64 kernels differ in the last bits,
    which Adam's two steps grow to about 1e-8; one step fewer moves a parameter by 1e-3, the lr (both
    measured)."""
    import importlib.util
    import shutil

    import torch

    from harness import launch, merged_params

    path = os.path.join(ROOT, "tests", "fixtures", "make_checkpoint_before_move.py")
    spec = importlib.util.spec_from_file_location("make_checkpoint_before_move", path)
    fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixture)
    load_dir = tmp_path / "ckpt"
    shutil.copytree(fixture.OUT, load_dir)
    expected = torch.load(load_dir / "expected.pt", weights_only=False)
    resumed = launch({**fixture.SPEC, "train_batches": 4, "load_dir": str(load_dir)})
    assert resumed[-1]["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    params = merged_params(resumed)
    assert params.keys() == expected["params"].keys()
    for name in params:
        torch.testing.assert_close(params[name], expected["params"][name], rtol=0, atol=1e-6, msg=name)


def test_traces_recorded_before_the_layers_replay():
    """tests/fixtures/trace_before_move: both ranks' communication of the run that wrote that checkpoint,
    recorded by the code before the layers; today's NCCL-rules replay reads and accepts it."""
    from petra_ds.verify.nccl_replay import load_traces, replay_nccl

    traces = load_traces(os.path.join(ROOT, "tests", "fixtures", "trace_before_move"))
    report = replay_nccl(traces)
    assert set(report.batches) == {0, 1} and report.transfers > 0


def test_importing_petra_ds_installs_no_import_hook_and_old_files_name_no_module():
    """Former module names are not kept alive by a global import hook: no finder of petra_ds's is in
    ``sys.meta_path`` once it is imported (here it is). What a run wrote before the package moved still loads
    without one: the checkpoint's pickles name no petra_ds class (only torch's and the builtins', which
    ``weights_only`` accepts) and the traces are JSON (the two tests above load both)."""
    import glob
    import sys

    import torch

    import petra_ds  # noqa: F401  (imported: any hook it installs is in place)

    assert [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("petra_ds")] == []
    files = glob.glob(os.path.join(ROOT, "tests", "fixtures", "checkpoint_before_move", "**", "*.pt"), recursive=True)
    assert len(files) == 9
    for path in files:
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == [], path


def test_one_walker_over_nested_tensors():
    """No function outside ``util/nested.py`` walks tensors in nested tuples / lists by calling itself: nested
    tensors are walked by ``tensors_in`` and rebuilt by ``map_tensors``, one walk. (Checked on the previous
    code: it named ``messages.to_device``, ``run_partition._to`` and ``measure._tensors`` / ``_leaves``.)"""
    walkers = []
    for path in python_files("petra_ds"):
        if path.endswith(os.path.join("util", "nested.py")):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if not isinstance(node, ast.FunctionDef):
                continue
            calls_itself = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == node.name
                               for n in ast.walk(node))
            checks_sequences = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance"
                                   and len(n.args) == 2 and "list" in ast.unparse(n.args[1]) for n in ast.walk(node))
            if calls_itself and checks_sequences and "Tensor" in ast.unparse(node):
                walkers.append(f"{os.path.relpath(path, ROOT)}: {node.name}")
    assert walkers == []


def test_deepspeeds_num_stages_is_never_rewritten():
    """DeepSpeed's ``num_stages`` counts pipeline ranks (P); petra_ds never assigns it, not even for a moment
    (PETRA's stage count J is ``num_petra_stages`` / ``petra_parts``)."""
    writes = []
    for path in python_files("petra_ds"):
        for node in ast.walk(ast.parse(open(path).read())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            writes += [f"{os.path.relpath(path, ROOT)}:{node.lineno}" for t in targets
                       if isinstance(t, ast.Attribute) and t.attr == "num_stages"]
    assert writes == []
