"""The house's floors, enforced: who may import whom, no imports hidden in functions, and no module
reading another's private names (docs/architecture.md draws the same rules).

- ``tracer/`` is layered: model, options, version, companion (0) <- analysis (1) <- record (2) <- features (3)
  <- loops, integrations, demo (4) <- api and the package itself (5). A module imports its own
  layer and those below. ``tracer`` never imports ``export``, but for ``python -m tracer``.
- ``export/`` imports, of ``tracer``, only the data model, the analyses, the options and the
  version; ``export/cli/`` may also import what ``gradtrace run`` and ``demo`` need. Nothing but
  the CLI imports the CLI.
- An import inside a function is allowed only for an optional heavy dependency, with its reason
  in a comment on that line.
- ``obj._name`` and ``from x import _name`` where ``_name`` belongs to another module of the
  project: a module's privates are its own.
- ``self._name`` where ``_name`` is a member (state or method) of a class in another file: a
  class's tables are read in the file that owns them, and other parts call its public methods
  (the recorder's parts, docs/architecture.md).

Everything is read from the source (``ast``): nothing is imported.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tracer", "export")

TRACER_LAYERS = {"model": 0, "options": 0, "version": 0, "companion": 0, "analysis": 1, "record": 2, "features": 3,
                 "loops": 4, "integrations": 4, "demo": 4, "api": 5, "__init__": 5}
EXPORT_MAY_IMPORT = ("tracer.model", "tracer.analysis", "tracer.options", "tracer.version")
CLI_MAY_ALSO_IMPORT = ("tracer.loops", "tracer.demo", "tracer.api", "tracer")
# PyTorch's own private names the recorder reads (feature-detected or with a fallback where they
# may be missing; see tracer/record/tensors.py): not the project's privates.
TORCH_PRIVATES = frozenset({"_C", "_version", "_base", "_cdata", "_schema", "_sequence_nr", "_current_autograd_node",
                            "_snapshot", "_record_memory_history", "_set_memory_metadata", "_get_ddp_logging_data",
                            "_module_parameters", "_comm_hooks", "_logging", "_functional_collectives",
                            "_parameters", "_buffers", "_post_accumulate_grad_hooks", "_ops", "_dynamo"})
# Optional or slow-to-import dependencies, imported where they are used (each with a reason on the
# line or the line above).
LAZY_OK = ("matplotlib", "triton", "graphviz", "transformers", "lightning", "pytorch_lightning", "torch.distributed",
           "tracer.record.checksums.triton_kernels", "torch.utils._debug_mode", "rich.progress")




@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted (for `from a import b`: a.b if b is a module, else a)
    names: tuple[str, ...]
    line: int
    in_function: bool
    commented: bool


def _modules() -> Iterator[tuple[str, str]]:
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    yield (rel[: -len(".__init__")] if rel.endswith(".__init__") else rel), path


MODULES = dict(_modules())


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level:
        base = module.split(".")
        if not MODULES.get(module, "").endswith("__init__.py"):
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, node.module] if node.module else base)
    return node.module or ""


def _imports(module: str, path: str) -> Iterator[Import]:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines()
    tree = ast.parse(source)
    funcs: list[tuple[int, int]] = [(n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree)
                                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    type_checking = [(n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree)
                     if isinstance(n, ast.If) and ast.unparse(n.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")]
    for n in ast.walk(tree):
        if not isinstance(n, ast.Import | ast.ImportFrom):
            continue
        if any(a <= n.lineno <= b for a, b in type_checking):
            continue  # annotations only: nothing is imported at run time
        in_function = any(a < n.lineno <= b for a, b in funcs)
        commented = "#" in lines[n.lineno - 1] or (n.lineno > 1 and lines[n.lineno - 2].strip().startswith("#"))
        if isinstance(n, ast.Import):
            for alias in n.names:
                yield Import(module, alias.name, (), n.lineno, in_function, commented)
        else:
            base = _resolve(module, n)
            for alias in n.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in MODULES else base
                yield Import(module, target, (alias.name,), n.lineno, in_function, commented)


IMPORTS = [imp for m, p in MODULES.items() for imp in _imports(m, p)]


def _tracer_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "tracer":
        return None
    if len(parts) == 1:
        return TRACER_LAYERS["__init__"]
    return TRACER_LAYERS.get(parts[1])


def _within(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def layer_violations(imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        m, t = imp.module, imp.target
        where = f"{m}:{imp.line} imports {t}"
        if m.startswith("tracer"):
            if t == "export" or t.startswith("export."):
                if m != "tracer.__main__":
                    out.append(f"{where}: recording must not depend on reporting")
                continue
            mine, theirs = _tracer_layer(m), _tracer_layer(t)
            if mine is None and m != "tracer.__main__":
                out.append(f"{m}: a module outside the layers (add it to TRACER_LAYERS)")
            elif theirs is not None and mine is not None and theirs > mine:
                out.append(f"{where}: layer {mine} imports layer {theirs}")
        elif m.startswith("export"):
            if _in_package(t, "export.cli") and not _in_package(m, "export.cli"):
                out.append(f"{where}: only the CLI imports the CLI")
            if t == "tracer" or t.startswith("tracer."):
                allowed = EXPORT_MAY_IMPORT + (CLI_MAY_ALSO_IMPORT if m.startswith("export.cli") else ())
                if not _within(t, allowed):
                    out.append(f"{where}: export reads the data model, analyses, options and version only")
    return out


def lazy_import_violations(imports: list[Import]) -> list[str]:
    return [f"{imp.module}:{imp.line} imports {imp.target} inside a function"
            + ("" if _within(imp.target, LAZY_OK) else " (not an optional heavy dependency)")
            + ("" if imp.commented else " (no reason given on the line)")
            for imp in imports if imp.in_function and not (_within(imp.target, LAZY_OK) and imp.commented)]


def _defined_privates(path: str) -> set[str]:
    """Private names a module defines: module-level names, class members, ``self._x``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name.startswith("_"):
            names.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                and isinstance(n.ctx, ast.Store) and n.attr.startswith("_"):
            names.add(n.attr)
        elif isinstance(n, ast.Assign | ast.AnnAssign):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for tgt in targets:
                if isinstance(tgt, ast.Name) and tgt.id.startswith("_"):
                    names.add(tgt.id)
    return {x for x in names if not x.startswith("__")}


def private_violations() -> list[str]:
    owners: dict[str, set[str]] = {}
    for m, p in MODULES.items():
        for name in _defined_privates(p):
            owners.setdefault(name, set()).add(m)
    out = []
    for m, p in MODULES.items():
        with open(p, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        mine = _defined_privates(p)
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                base = n.value
                if (isinstance(base, ast.Name) and base.id in ("self", "cls")) or n.attr in TORCH_PRIVATES:
                    continue
                if n.attr in owners and n.attr not in mine:
                    out.append(f"{m}:{n.lineno} reads {ast.unparse(n)} (a private of {', '.join(sorted(owners[n.attr]))})")
            elif isinstance(n, ast.ImportFrom):
                for alias in n.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") \
                            and (n.module or "").split(".")[0] in PACKAGES:
                        out.append(f"{m}:{n.lineno} imports {alias.name} from {n.module}")
    return out


def _own_members(tree: ast.AST) -> set[str]:
    """The private members a module's classes own: ``self._x`` assigned, ``def _x`` in a class body."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):
            names.update(f.name for f in n.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef))
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                and isinstance(n.ctx, ast.Store):
            names.add(n.attr)
    return {x for x in names if x.startswith("_") and not x.startswith("__")}


def _in_package(module: str, package: str) -> bool:
    """``module`` is ``package`` or inside it (``export.clipping`` is not in ``export.cli``)."""
    return module == package or module.startswith(package + ".")


def self_private_violations(modules: dict[str, str]) -> list[str]:
    """``self._x`` read in one module where ``_x`` is a member another module's class owns (and
    this module's classes do not): state or a method shared across files through inheritance
    (a mixin reading its siblings' tables). A class's private members are read in the file that
    assigns them; other files call its public methods."""
    trees = {}
    for m, p in modules.items():
        with open(p, encoding="utf-8") as f:
            trees[m] = ast.parse(f.read())
    owned = {m: _own_members(tree) for m, tree in trees.items()}
    owners: dict[str, set[str]] = {}
    for m, names in owned.items():
        for name in names:
            owners.setdefault(name, set()).add(m)
    out = []
    for m, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                    and not isinstance(n.ctx, ast.Store) and n.attr in owners and n.attr not in owned[m]:
                out.append(f"{m}:{n.lineno} reads self.{n.attr} (owned by {', '.join(sorted(owners[n.attr]))})")
    return out


def test_layers_are_respected() -> None:
    assert layer_violations(IMPORTS) == []


def test_no_imports_hidden_in_functions() -> None:
    assert lazy_import_violations(IMPORTS) == []


def test_no_module_reads_another_modules_privates() -> None:
    assert private_violations() == []


def test_a_class_keeps_its_members_to_its_file() -> None:
    assert self_private_violations(MODULES) == []


def test_a_member_read_from_another_file_is_caught(tmp_path) -> None:
    """A mixin reading its sibling's table through ``self`` is refused; a class reading its own
    members, or another part's public method, is not."""
    (tmp_path / "state.py").write_text("class State:\n    def __init__(self):\n        self._names = {}\n\n"
                                       "    def name_of(self, t):\n        return self._names.get(t)\n")
    (tmp_path / "graph.py").write_text("from state import State\n\nclass Graph(State):\n"
                                       "    def node(self, t):\n        return self._names[t]\n")
    (tmp_path / "part.py").write_text("class Part:\n    def __init__(self, names):\n        self._own = names\n\n"
                                      "    def node(self, t):\n        return self._own.name_of(t)\n")
    modules = {m: str(tmp_path / f"{m}.py") for m in ("state", "graph", "part")}
    assert self_private_violations(modules) == ["graph:5 reads self._names (owned by state)"]


@pytest.mark.parametrize("module, target, message", [
    ("tracer.model.trace", "tracer.analysis.numerics", "layer 0 imports layer 1"),
    ("tracer.record.session", "tracer.features.memory", "layer 2 imports layer 3"),
    ("tracer.analysis.numerics", "export.html", "recording must not depend on reporting"),
    ("export.summary", "tracer.record.recorder", "export reads the data model"),
    ("export.text", "export.cli.main", "only the CLI imports the CLI"),
])
def test_a_broken_rule_is_caught(module, target, message) -> None:
    """Break each rule on purpose: the checks above would fail."""
    bad = Import(module, target, (), 1, False, False)
    assert any(message in v for v in layer_violations([bad]))


def test_a_module_whose_name_begins_like_the_cli_is_not_the_cli() -> None:
    """``export.clipping`` is a sibling of ``export.cli``, not inside it: the pages may import it."""
    assert layer_violations([Import("export.html.page", "export.clipping", (), 1, False, False)]) == []


def test_a_function_level_import_needs_a_reason_and_a_heavy_dependency() -> None:
    assert lazy_import_violations([Import("tracer.features.memory", "matplotlib", (), 3, True, True)]) == []
    assert lazy_import_violations([Import("tracer.features.memory", "matplotlib", (), 3, True, False)])
    assert lazy_import_violations([Import("tracer.record.session", "tracer.features.logs", (), 3, True, True)])


def test_export_knows_every_dtype_size_without_torch() -> None:
    """export renders a trace without importing torch: its table of element sizes covers every
    dtype this torch has (a new one shows up here)."""
    import torch

    from export.views import itemsize

    dtypes = {name: d for name in dir(torch) if isinstance(d := getattr(torch, name), torch.dtype)}
    assert {str(d).removeprefix("torch."): itemsize(str(d).removeprefix("torch.")) for d in dtypes.values()} == \
        {str(d).removeprefix("torch."): d.itemsize for d in dtypes.values()}


def test_reading_a_trace_needs_no_torch() -> None:
    """`import tracer`, `tracer.load` and the report library load without torch (names that
    record import it on first use), so a saved trace is read and rendered where torch is
    missing."""
    import subprocess
    import sys

    code = ("import sys; import tracer, tracer.model, tracer.analysis.numerics, export, export.summary, export.text, "
            "export.html, export.dot, export.diff, export.load; "
            "tracer.TraceOptions(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_a_private_read_across_modules_is_caught(tmp_path, monkeypatch) -> None:
    """Break the private-name rule on purpose, in both forms (``from x import _y`` and ``x._y``):
    the check above would fail. A module's own privates, ``self._x`` and torch's are not flagged."""
    fake = _fake_modules(tmp_path, {
        "tracer.model.owner": "_LIMIT = 3\n\ndef _helper():\n    return _LIMIT\n",
        "tracer.model.reader": "import torch\nfrom tracer.model import owner\nfrom tracer.model.owner import _helper\n\n"
                               "class Box:\n    def __init__(self):\n        self._mine = owner._LIMIT\n\n"
                               "    def get(self):\n        return self._mine, _helper(), torch._C\n",
    })
    monkeypatch.setitem(globals(), "MODULES", fake)  # private_violations reads this module's MODULES
    assert sorted(private_violations()) == [
        "tracer.model.reader:3 imports _helper from tracer.model.owner",
        "tracer.model.reader:7 reads owner._LIMIT (a private of tracer.model.owner)",
    ]


def _fake_modules(folder: os.PathLike[str], sources: dict[str, str]) -> dict[str, str]:
    """Modules written to ``folder``, keyed by dotted name as ``MODULES`` is."""
    paths = {}
    for name, source in sources.items():
        paths[name] = os.path.join(folder, name.replace(".", "_") + ".py")
        with open(paths[name], "w", encoding="utf-8") as fh:
            fh.write(source)
    return paths
