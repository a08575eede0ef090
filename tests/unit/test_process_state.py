"""Process-wide state: every module-level value that code changes at run time is listed here, with why
it is per process rather than per checkpointer (docs/ARCHITECTURE.md's table), and it says why at its
definition.

State a user could run twice (two models saving to two roots: caches, buffers, in-flight bookkeeping)
belongs to the object that owns a save stream (:class:`cpuckpt.Checkpointer`, a memory tier, an
adapter's run), so a new module-level cache, registry or flag fails this test until it is either moved
there or added below with its reason. The source is read, not imported: what counts is what the code
can change, found by reading every module of ``cpuckpt`` and ``integrations``:

- a module-level name rebound in a function (``global``), or from another module (``mod._X = ...``);
- a module-level container mutated in a function (item assignment or deletion, ``append``, ``add``,
  ``update``, ``pop``, ``setdefault``, ``clear``, ``remove``, ``discard``, slice assignment);
- a module-level instance of a class that is not a lock, a ``Struct``, a ``Path`` or a type variable.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cpuckpt", "integrations")
MUTATORS = {"append", "add", "update", "pop", "popitem", "setdefault", "clear", "remove", "discard", "extend",
            "insert"}
IMMUTABLE_CLASSES = {"Lock", "RLock", "Struct", "Path", "TypeVar", "ParamSpec", "Event", "Condition"}

# (module, name) -> why it is per process. Everything else a user could run twice is per stream.
PER_PROCESS = {
    ("integrations/deepspeed/engine.py", "_RESERVED_DIRS"): "a RAM root opens once per process: one engine reserves",
    ("cpuckpt/format/metapickle.py", "_PICKLES"): "cached plans' structures (weakly), a pickle per slot",
    ("cpuckpt/transfer/staging.py", "_POOL"): "pinning costs 0.4-0.6 s/GiB: one bounded pool, registered once",
    ("cpuckpt/transfer/threads.py", "_SHARED"): "thread start-up is stall time; tasks of every stream run FIFO",
    ("cpuckpt/transfer/pacing.py", "PACER"): "one piece in flight on the device link all streams share",
    ("cpuckpt/transfer/objstore.py", "_LOADER"): "botocore's service models parsed once (0.25 s per session)",
    ("cpuckpt/backend/collectives.py", "_GROUPS"): "process groups are per process; creating one is collective",
    ("cpuckpt/roots.py", "_LOADING"): "retention after any stream's commit skips what this process loads",
    ("cpuckpt/tier/nodecopies.py", "_CLASSES"): "one subclass per planner class: a stable identity (plan key)",
    ("cpuckpt/faultpoint.py", "_HANDLER"): "tests install one handler for every thread of the process",
    ("cpuckpt/tier/pinning.py", "_populate_works"): "whether this kernel has MADV_POPULATE_WRITE: the process's",
    ("cpuckpt/tier/persister.py", "_MY_LAST_PART"): "the writer process is one rank's: the parts it wrote, per path",
    ("cpuckpt/backend/inflight.py", "_STREAMS"): "its readers (retention, SIGTERM, wait_all) ask about the process",
    ("cpuckpt/background.py", "_DEFAULTS"): "the function API (cpuckpt.async_save) has no object: one per group",
    ("cpuckpt/background.py", "_EXIT_HOOKED"): "the exit hook is registered once per interpreter",
    ("cpuckpt/transfer/files.py", "_BACKENDS"): "the io.backend registry: names resolve alike everywhere",
    ("cpuckpt/transfer/files.py", "_PROBED"): "O_DIRECT support is a property of the device (st_dev)",
    ("cpuckpt/transfer/tracing.py", "_CUDA"): "whether CUDA (NVTX) is there does not change in a process",
    ("cpuckpt/config.py", "_warned_env"): "an environment variable is warned about once per process",
    ("integrations/deepspeed/__init__.py", "_STATE"): "install() patches DeepSpeed's factory, once per process",
    ("integrations/megatron/compat.py", "_warned"): "a version difference is warned about once per process",
    ("integrations/megatron/deferred.py", "_STARTS"): "start points are process-wide (the queue, any step)",
    ("integrations/megatron/deferred.py", "_ENABLED"): "a watched queue exists in this process",
    ("integrations/megatron/guard.py", "_LOG_LOOKS"): "a log looked in this process (its queue may not exist yet)",
    ("integrations/megatron/fallback.py", "_LOADING"): "Megatron-LM's load_checkpoint is one function per process",
    ("integrations/megatron/prepare.py", "_PREPARER"): "it prepares the one pool, from patched optimizer classes",
    ("integrations/megatron/prepare.py", "_DEPTH"): "per thread: nested wrapped optimizer steps",
    ("integrations/megatron/strategy.py", "_PENDING"): "a wrapped step cannot tell which model a save is of",
    ("integrations/megatron/strategy.py", "_STEPS_ORDERED"): "the optimizer classes are patched per process",
    ("integrations/megatron/worker.py", "_cleaned_stale"): "stale channel files are cleaned once per process",
    ("integrations/megatron/worker.py", "_watching"): "the worker process watches one parent",
}


def _module_names(tree: ast.Module) -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Name) and t.id != "__all__":
                out[t.id] = node
    return out


def _changed_in_functions(tree: ast.Module) -> set[str]:
    changed: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                changed.update(node.names)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                        changed.add(t.value.id)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name)):
                changed.add(node.func.value.id)
    return changed


def _rebound_from_outside(trees: dict[str, ast.Module]) -> set[str]:
    """Private names assigned as ``<name>.<attr> = ...`` anywhere (``strategy._STEPS_ORDERED = True``)."""
    out: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id not in ("self", "cls") and t.attr.startswith("_")):
                        out.add(t.attr)
    return out


def _instance_class(node: ast.stmt) -> str | None:
    value = getattr(node, "value", None)
    if not isinstance(value, ast.Call):
        return None
    f = value.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    if (name[:1].isupper() and name not in IMMUTABLE_CLASSES) or name in ("local", "WeakSet"):
        return name
    return None


def _trees() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
            for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def process_state() -> dict[tuple[str, str], ast.stmt]:
    """Every module-level value some code changes at run time, by (module, name)."""
    trees = _trees()
    outside = _rebound_from_outside(trees)
    found: dict[tuple[str, str], ast.stmt] = {}
    for module, tree in trees.items():
        names = _module_names(tree)
        changed = _changed_in_functions(tree)
        for name, node in names.items():
            if name in changed or name in outside or _instance_class(node) is not None:
                found[(module, name)] = node
    return found


def test_every_process_wide_value_is_listed_with_its_reason():
    found = process_state()
    unlisted = sorted(set(found) - set(PER_PROCESS))
    assert not unlisted, ("module-level state that is not in PER_PROCESS: make it per checkpointer (owned by the "
                          f"object that owns the save stream), or list it with why it is per process: {unlisted}")
    gone = sorted(set(PER_PROCESS) - set(found))
    assert not gone, f"listed as process-wide state but no longer found (take them off PER_PROCESS): {gone}"


def test_each_process_wide_value_says_why_where_it_is_defined():
    """A comment on its line or right above it (the reason a reader sees at the definition)."""
    missing = []
    for (module, name), node in sorted(process_state().items()):
        lines = (ROOT / module).read_text().splitlines()
        here = lines[node.lineno - 1]
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        if "#" not in here and not above.startswith("#"):
            missing.append(f"{module}:{node.lineno} {name}")
    assert not missing, f"no comment saying why these are per process: {missing}"


def test_what_a_user_could_run_twice_is_per_checkpointer():
    """The caches, buffers and in-flight bookkeeping of a save stream are not module state."""
    found = {name for _, name in process_state()}
    for name in ("_CHECKPOINTERS", "_LAYOUTS", "_BUFFERS", "_SAVES", "_MEMORY"):
        assert name not in found, name


def test_architecture_lists_what_is_per_process():
    """docs/ARCHITECTURE.md's table (section 1.3) names every value kept per process, and nothing else."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("### 1.3 ", 1)[1].split("\n## ", 1)[0]
    rows = {(m.replace(".", "/") + ".py", n) for m, n in
            (tuple(c.strip().strip("`") for c in line.split("|")[1:3]) for line in section.splitlines()
             if line.startswith("| `"))}
    assert rows == set(PER_PROCESS), (sorted(rows - set(PER_PROCESS)), sorted(set(PER_PROCESS) - rows))
