"""The house's walls, read from disk: which folder of tfpar may import which
(docs/how-it-works.md, "The layout"), where TensorFlow's internals may be
reached, who may edit graphs, who may record what the data-parallel rewrite
made, and how long a module or a function may grow. Every rule is checked on
every module file, so new files are covered."""
import ast
import os
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfpar"
# Modules at the package's top level, by the layer they belong to.
BASE = {"errors", "fallback", "config", "config_schema", "config_rules"}
ENTRY = {"api", "cli", "plan_models", "__init__"}
# What each layer may import of tfpar, besides itself (docs/how-it-works.md's picture, top down).
MAY_IMPORT = {
    "entry": {"models", "runtime", "hooks", "rewriters", "analysis", "patterns", "planner", "ir",
              "cluster", "compat", "base"},
    "models": {"base"},
    "runtime": {"hooks", "rewriters", "analysis", "patterns", "planner", "ir", "cluster", "compat",
                "base"},
    "hooks": {"patterns", "ir", "compat", "base"},
    "rewriters": {"analysis", "ir", "compat", "base"},
    "analysis": {"planner", "ir", "compat", "base"},
    "patterns": {"ir", "compat", "base"},
    "planner": {"ir", "cluster", "base"},
    "cluster": {"base"},
    "ir": {"base"},
    "compat": set(),
    "base": set(),
}
INTERNALS = ("tensorflow.python", "tensorflow.core", "keras.src", "tf_keras.src")
# compat.tf functions that edit a graph: only rewriters/ may call them.
GRAPH_EDITS = {"update_input", "add_control_input", "set_control_inputs", "set_device",
               "clear_attr", "unfinalize", "refinalize"}
# Python's own underscored functions, documented for use.
PYTHON_PRIVATE_OK = {("os", "_exit"), ("sys", "_getframe")}
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60
# The modules that assign to the rewrite's builder (rewriters.rewrite_record.RewriteBuilder):
# the driver, recording what each pass returns, and the builder's own memo.
RECORDERS = {"rewriters/data_parallel.py", "rewriters/rewrite_record.py"}
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "add", "discard", "remove",
            "pop", "popitem", "clear"}


def _layer(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    if len(parts) > 1:
        return parts[0]
    stem = path.stem
    return "entry" if stem in ENTRY else "base" if stem in BASE else stem


def _layer_of_module(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return "entry"  # "import tfpar" / "from tfpar import x" (checked by the x)
    first = parts[1]
    if (PACKAGE / first).is_dir():
        return first
    return "entry" if first in ENTRY else "base" if first in BASE else first


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _tfpar_imports(tree: ast.AST):
    """(line, imported module's layer) for every import of tfpar in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tfpar":
            names = ([f"tfpar.{a.name}" for a in node.names] if node.module == "tfpar"
                     else [node.module])
            for name in names:
                yield node.lineno, _layer_of_module(name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tfpar":
                    yield node.lineno, _layer_of_module(alias.name)


def test_every_module_belongs_to_a_known_layer():
    unknown = {str(p.relative_to(PACKAGE)) for p in _modules() if _layer(p) not in MAY_IMPORT}
    assert not unknown, f"add these to a layer (MAY_IMPORT and docs/how-it-works.md's layout): {unknown}"


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for path in _modules():
        layer = _layer(path)
        for line, imported in _tfpar_imports(ast.parse(path.read_text())):
            if imported != layer and imported not in MAY_IMPORT.get(layer, set()):
                wrong.append(f"{path.relative_to(PACKAGE)}:{line}: {layer} -> {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_rules_have_no_circle():
    """The rules themselves run one way: no layer may import one that may import it."""
    def below(layer, seen=()):
        for lower in MAY_IMPORT[layer]:
            assert lower not in seen + (layer,), f"circle through {layer} -> {lower}"
            below(lower, seen + (layer,))
    for layer in MAY_IMPORT:
        below(layer)


def test_tensorflow_internals_are_imported_only_in_compat():
    found = []
    for path in _modules():
        if _layer(path) == "compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {n}" for n in names
                      if n.startswith(INTERNALS)]
    assert not found, "\n".join(found)


def _own_attributes(tree: ast.AST):
    """{class node: attribute names its methods assign on self}."""
    owned = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        owned[cls] = {t.attr for n in ast.walk(cls) for t in getattr(n, "targets", [])
                      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                      and t.value.id == "self"}
        owned[cls] |= {n.target.id for n in cls.body
                       if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        owned[cls] |= {n.args[1].value for n in ast.walk(cls)  # object.__setattr__(self, "_x", v)
                       if isinstance(n, ast.Call) and ast.unparse(n.func) == "object.__setattr__"
                       and len(n.args) == 3 and isinstance(n.args[1], ast.Constant)}
    return owned


def _protected_accesses(tree: ast.AST):
    """``x._name`` accesses to a member neither of ``self``/``cls`` nor of
    the class the access is written in."""
    owned = _own_attributes(tree)
    inside = {}
    for cls, names in owned.items():
        for node in ast.walk(cls):
            inside.setdefault(node, set()).update(names)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        base = node.value.id if isinstance(node.value, ast.Name) else None
        if base in ("self", "cls") or (base, node.attr) in PYTHON_PRIVATE_OK:
            continue
        if node.attr in inside.get(node, set()):
            continue
        yield node.lineno, ast.unparse(node)


def test_private_members_are_reached_only_in_compat():
    found = [f"{path.relative_to(PACKAGE)}:{line}: {text}" for path in _modules()
             if _layer(path) != "compat"
             for line, text in _protected_accesses(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_only_rewriters_edit_graphs():
    """compat.tf's graph edits are called from rewriters/ alone."""
    found = []
    for path in _modules():
        if _layer(path) in ("rewriters", "compat"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            called = (node.attr if isinstance(node, ast.Attribute) else
                      node.name if isinstance(node, ast.alias) else None)
            if called in GRAPH_EDITS and ("internals" in ast.unparse(node) or
                                          isinstance(node, ast.alias)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {called}")
    assert not found, "\n".join(found)


def _builder_names(function: ast.AST, cls) -> set:
    """The names a function holds the rewrite's builder (or record) in: ``rw``,
    its parameters annotated ``RewriteBuilder``, and ``self`` in that class."""
    args = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return {"rw"} | {a.arg for a in args if a.annotation is not None
                     and "RewriteBuilder" in ast.unparse(a.annotation)} | (
        {"self"} if cls == "RewriteBuilder" else set())


def _written_part(node: ast.AST, names: set) -> bool:
    """``node`` is a part of a builder: ``rw.field``, ``rw.field[k]``, ``rw.field.x``..."""
    attribute = False
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        attribute |= isinstance(node, ast.Attribute)
        node = node.value
    return attribute and isinstance(node, ast.Name) and node.id in names


def _builder_writes(tree: ast.AST):
    """(line, code) of every assignment to a part of the rewrite's builder, and
    every call changing one in place (``rw.x.update(...)``, ``setattr(rw, ...)``)."""
    classes = {f: c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
               for f in c.body if isinstance(f, ast.FunctionDef)}
    for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        names = _builder_names(function, classes.get(function))
        for node in ast.walk(function):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                targets += [node.func.value] if node.func.attr in MUTATORS else []
            if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                    "setattr", "object.__setattr__") and node.args:
                targets.append(ast.Attribute(node.args[0], "_", ast.Load()))
            if any(_written_part(t, names) for t in targets):
                yield node.lineno, ast.unparse(node).splitlines()[0]


def test_only_the_driver_records_what_the_rewrite_made():
    """Passes of the data-parallel rewrite read the builder and return what they
    made; only ``RECORDERS`` assign to it (issue 62)."""
    found = [f"{path.relative_to(PACKAGE)}:{line}: {code}" for path in _modules()
             if str(path.relative_to(PACKAGE)) not in RECORDERS
             for line, code in _builder_writes(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)
    assert all(list(_builder_writes(ast.parse((PACKAGE / module).read_text())))
               for module in RECORDERS), "a recorder that records nothing: drop it from RECORDERS"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_short(path):
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{lines} lines: split it by concern"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_layers_cover_the_package_folders():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert folders - {"__pycache__"} <= set(MAY_IMPORT), folders
    assert os.path.isfile(PACKAGE / "compat" / "tf.py")


def test_the_layout_picture_draws_every_layer():
    """docs/how-it-works.md's layout picture names every folder and top-level module layer."""
    page = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    picture = page[page.index("## The layout"):page.index("**TF2 steps.**")]
    folders = [layer for layer in MAY_IMPORT if (PACKAGE / layer).is_dir()]
    missing = [f"{f}/" for f in folders if f"{f}/" not in picture]
    missing += [f"{m}.py" for m in sorted(ENTRY | {"errors", "fallback"})
                if f"{m}.py" not in picture]
    assert not missing, missing
