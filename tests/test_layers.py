"""The layout's contracts: the import layers hold (import-linter) and every import resolves statically.

The layers (entry points > ipc > runtime (scheduler side | worker side > common) > model > kernels
(cpu | cuda)), the ban on ZeroMQ below ipc and on import circles are declared in pyproject.toml's
``[tool.importlinter]``; this runs the same check ``lint-imports`` runs. Static resolution is checked
with jedi on the checkout alone (no installed package on its path): imports across the top-level
folders and from the entry points must land in the file that defines the name. Imports by a name
given at run time (``importlib.import_module``, ``__import__``), which import-linter cannot see, are
read from the source and held to the same contracts.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout, r.stdout[-4000:]


def _cross_folder_imports(limit_per_file: int = 3):
    """(file, line, column, name, top folder of the target) for ``from X import name`` statements of
    the package whose module lies in another top-level folder than the importing file."""
    out = []
    for folder in ("folio", "ipc", "runtime", "model", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents if ROOT in p.parents):
                continue
            rel = path.relative_to(ROOT)
            tree = ast.parse(path.read_text())
            lines = path.read_text().splitlines()
            n = 0
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or not node.module or node.lineno != node.end_lineno:
                    continue
                if node.level:
                    base = list(rel.parent.parts)[: len(rel.parent.parts) - (node.level - 1)]
                    target = base + node.module.split(".")
                elif node.module.startswith("folio."):
                    target = ["folio"] + node.module.split(".")[1:]
                else:
                    continue
                top = target[1] if target[0] == "folio" and len(target) > 1 else target[0]
                if top == rel.parts[0] or top not in ("ipc", "runtime", "model", "kernels"):
                    continue
                name = node.names[0].name
                line = lines[node.lineno - 1]
                col = line.index(" import ") + len(" import ") + line[line.index(" import ") + 8:].index(name)
                out.append((path, node.lineno, col, name, top))
                n += 1
                if n >= limit_per_file:
                    break
    return out


def test_cross_folder_imports_resolve_statically():
    import jedi   # in the test extra: missing, the install is broken (an error, not a skip)
    project = jedi.Project(str(ROOT), sys_path=[str(ROOT)], smart_sys_path=False)
    cases = _cross_folder_imports()
    assert len(cases) >= 40, f"too few cross-folder imports found to check ({len(cases)})"
    unresolved = []
    for path, line, col, name, top in cases:
        script = jedi.Script(path=str(path), project=project)
        found = script.goto(line, col, follow_imports=True)
        files = {str(pathlib.Path(d.module_path).resolve()) for d in found if d.module_path}
        if not any(f.startswith(str(ROOT / top) + "/") for f in files):
            unresolved.append(f"{path.relative_to(ROOT)}:{line} {name} -> {sorted(files) or 'nothing'}")
    assert not unresolved, "imports static tools cannot follow:\n" + "\n".join(unresolved)


def test_the_wheel_lists_every_package():
    """pyproject.toml names the packages explicitly (the subpackages come through links): a new
    folder with an ``__init__.py`` must be listed, or the installed wheel would lack it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for folder, _, files in os.walk(ROOT / "folio", followlinks=True):  # through folio/kernels -> ../kernels
        rel = pathlib.Path(folder).relative_to(ROOT)
        if "__init__.py" in files and "__pycache__" not in rel.parts:
            on_disk.add(".".join(rel.parts))
    assert on_disk == listed, f"missing from pyproject: {sorted(on_disk - listed)}; not packages: {sorted(listed - on_disk)}"


def test_the_package_never_imports_the_top_level_folders_by_their_own_names():
    """``kernels``, ``model``, ``runtime`` and ``ipc`` are importable as top-level names from the
    checkout (and static tools offer them), but an installed folio has only ``folio``: inside the
    package they are reached as ``folio.X`` or relatively, never as ``X`` (import-linter sees such an
    import as an external package and cannot flag it)."""
    tops = {"kernels", "model", "runtime", "ipc", "perf", "tests"}
    bad = []
    for folder in ("folio", "ipc", "runtime", "model", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(p.is_symlink() for p in [path, *path.parents] if ROOT in p.parents):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                         else [])
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in tops]
    assert not bad, "imports by a top-level folder's own name (use folio.X or a relative import):\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------------------
# imports by name at run time (importlib.import_module, __import__), which import-linter cannot see
# ----------------------------------------------------------------------------------------------

_LIBRARY_FOLDERS = ("folio", "ipc", "runtime", "model", "kernels")

RUN_TIME_NAMES = {
    ("ipc/worker_process.py", "_load_factory"): "the step runner's factory, 'module:function' from the engine config",
    ("kernels/cuda/table.py", "get_cuda_kernels"): "$FOLIO_CUDA_TABLE, a table factory for dry runs",
}
"""Imports whose module is named at run time, by the caller (file, enclosing function): the only ones
the scan below may leave unresolved."""


def _library_files():
    """``(path, module name, package name)`` of every library module (``folio/ipc`` is ``ipc/``, once)."""
    for folder in _LIBRARY_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(p.is_symlink() for p in [path, *path.parents] if ROOT in p.parents):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            parts = parts if parts[0] == "folio" else ["folio"] + parts
            package = parts[:-1]
            module = package if parts[-1] == "__init__" else parts
            yield path, ".".join(module), ".".join(package)


def _module_constants(tree) -> dict[str, list[str]]:
    # NAME = "x" / ["x", "y"] / ("x", "y") at module level
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values):
                for t in targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = [v.value for v in values]
    return out


def _string_prefix(node) -> str | None:
    """The text of a name argument, or of its leading constant part (an f-string, ``"a." + b``),
    cut after its last dot when a part is computed: the package it lies in at least."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        head = ""
        for v in node.values:
            if not (isinstance(v, ast.Constant) and isinstance(v.value, str)):
                return head[: head.rfind(".") + 1] if "." in head else None
            head += v.value
        return head
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _string_prefix(node.left)
        return left[: left.rfind(".") + 1] if left and "." in left else None
    return None


def _resolve(name: str, package: str) -> str:
    """An absolute module name: relative names against ``package``, the top-level folders as folio's."""
    if name.startswith("."):
        level = len(name) - len(name.lstrip("."))
        base = package.split(".")[: len(package.split(".")) - (level - 1)]
        name = ".".join(base + [p for p in name.lstrip(".").split(".") if p])
    name = name.rstrip(".")
    if name.split(".")[0] in _LIBRARY_FOLDERS[1:]:
        name = "folio." + name
    return name


def dynamic_imports():
    """``(resolved, unresolved)``: ``(file, line, importer, imported)`` for every call of
    ``import_module`` / ``__import__`` in the library whose module name the scan can read (a
    constant, a module-level constant or a loop over one, an f-string's constant head: its package),
    and ``(file, line, enclosing function)`` for the others."""
    resolved, unresolved = [], []
    for path, module, package in _library_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = _module_constants(tree)
        rel = str(path.relative_to(ROOT))

        def visit(node, function, loops):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                function, loops = node.name, {}
            if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                    and isinstance(node.iter, ast.Name) and node.iter.id in consts:
                loops = {**loops, node.target.id: consts[node.iter.id]}
            called = node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else \
                node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
            if called in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                # import_module(name, package): relative names against the package
                pkg_arg = node.args[1] if called == "import_module" and len(node.args) > 1 else None
                pkg_arg = next((k.value for k in node.keywords if k.arg == "package"), pkg_arg)
                pkg = package if isinstance(pkg_arg, ast.Name) and pkg_arg.id == "__package__" else \
                    pkg_arg.value if isinstance(pkg_arg, ast.Constant) else package
                if isinstance(arg, ast.Name) and (arg.id in loops or arg.id in consts):
                    names = loops.get(arg.id) or consts[arg.id]
                else:
                    head = _string_prefix(arg)
                    names = [head] if head and head.strip(".") else None
                if names is None:
                    unresolved.append((rel, node.lineno, function))
                else:
                    resolved.extend((rel, node.lineno, module, _resolve(n, pkg)) for n in names)
            for child in ast.iter_child_nodes(node):
                visit(child, function, loops)

        visit(tree, None, {})
    return resolved, unresolved


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def broken_contracts(importer: str, imported: str, contracts: list[dict]) -> list[str]:
    """The names of the import-linter contracts of pyproject.toml that a direct import of
    ``imported`` by ``importer`` breaks: ``forbidden`` (a source module importing a forbidden one)
    and ``layers`` (a lower layer importing a higher one, or independent siblings, ``a | b``, each
    other). The cycle contract is left to import-linter: these imports are too few to close one."""
    broken = []
    for c in contracts:
        if c["type"] == "forbidden":
            if any(_within(importer, s) for s in c["source_modules"]) and \
                    any(_within(imported, f) for f in c["forbidden_modules"]):
                broken.append(c["name"])
        elif c["type"] == "layers":
            for container in c.get("containers") or [""]:
                def place(module):
                    for i, layer in enumerate(c["layers"]):
                        independent = "|" in layer
                        for sibling in (s.strip() for s in layer.replace("|", ":").split(":")):
                            if _within(module, f"{container}.{sibling}" if container else sibling):
                                return i, sibling, independent
                    return None
                a, b = place(importer), place(imported)
                if a and b and (b[0] < a[0] or (a[0] == b[0] and a[1] != b[1] and a[2])):
                    broken.append(c["name"])
    return broken


def test_imports_by_name_at_run_time_keep_the_layers():
    """``importlib.import_module(name)`` and ``__import__(name)`` are imports import-linter cannot
    see: every one in the library whose name the scan can read keeps pyproject.toml's contracts
    (an f-string's constant head counts as the package it names), and the only ones it cannot read
    take their module from the caller at run time (``RUN_TIME_NAMES``)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    resolved, unresolved = dynamic_imports()
    assert any(imported == "folio.cmd_serve" for *_, imported in resolved), resolved   # the scan reads the CLI's list
    assert broken_contracts("folio.runtime.worker.x", "folio.kernels.cpu.rows", contracts)   # the check can fail
    assert broken_contracts("folio.model.x", "folio.runtime.worker", contracts)
    assert not broken_contracts("folio.runtime.worker.x", "folio.kernels.table", contracts)
    bad = [f"{rel}:{line} {importer} -> {imported}: {', '.join(names)}"
           for rel, line, importer, imported in resolved
           if imported.startswith("folio.") and (names := broken_contracts(importer, imported, contracts))]
    assert not bad, "imports by name that cross the layers:\n" + "\n".join(bad)
    stray = [f"{rel}:{line} in {fn}" for rel, line, fn in unresolved if (rel, fn) not in RUN_TIME_NAMES]
    assert not stray, "imports by a name the scan cannot read (name the module, or list it in RUN_TIME_NAMES):\n" \
        + "\n".join(stray)
