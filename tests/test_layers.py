"""Imports only point down the layers: ops <- models <- planning <- executor <- engine <- public API <- serving
(the executor reads only the plan's declaration, `fastgen.planning.plan`, not the policy).

Every module's `fastgen...` imports are read from its source (nothing is imported), so a new
upward import fails here with the line that made it.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"fastgen": "fastgen", "models": "fastgen.models", "ops": "fastgen.ops", "serving": "fastgen.serving"}
DATA_TYPES = ("fastgen.config", "fastgen.sampling_params", "fastgen.structured_outputs", "fastgen.outputs")
PUBLIC = ("fastgen", "fastgen.api", "fastgen.mii_options", "fastgen.engine", *DATA_TYPES)
"""What serving may import from fastgen: the top-level modules and the engine package's exports."""

# Module prefix -> what its imports may name (a name ending in "." also allows its submodules).
ALLOWED = [
    ("fastgen.ops", ["fastgen.ops."]),
    ("fastgen.models", ["fastgen.models.", "fastgen.ops."]),
    ("fastgen.planning", ["fastgen.planning.", "fastgen.models.", "fastgen.ops."]),
    # The executor builds what the plan says: it reads the plan's declaration (the contract), never the policy.
    ("fastgen.executor", ["fastgen.executor.", "fastgen.planning.plan", "fastgen.models.", "fastgen.ops."]),
    ("fastgen.engine", ["fastgen.engine.", "fastgen.executor.", "fastgen.planning.", "fastgen.models.",
                        "fastgen.ops.", *DATA_TYPES]),
    ("fastgen.sampling_params", ["fastgen.structured_outputs"]),
    ("fastgen.structured_outputs", []),
    ("fastgen.outputs", []),
    ("fastgen.config", ["fastgen.planning.", "fastgen.models."]),
    ("fastgen.mii_options", ["fastgen.config"]),
    # The public API may use every part but serving, which it imports only inside serve()/client().
    ("fastgen.api", ["fastgen.engine.", "fastgen.executor.", "fastgen.planning.", "fastgen.models.",
                     "fastgen.ops.", "fastgen.mii_options", *DATA_TYPES]),
    ("fastgen.__init__", ["fastgen.api", "fastgen.engine", "fastgen.planning.", "fastgen.mii_options", *DATA_TYPES]),
    # Serving sees the public API only: the top-level modules and the engine package's exports. Inside it,
    # the protocols (grpc/, http/) share only the common modules; deployments (deploy/) and the client
    # put the pieces together.
    ("fastgen.serving", ["fastgen.serving.", *PUBLIC]),
    ("fastgen.serving.limits", [*PUBLIC]),
    ("fastgen.serving.metrics", [*PUBLIC]),
    ("fastgen.serving.admission", [*PUBLIC]),
    ("fastgen.serving.backend", [*PUBLIC]),
    ("fastgen.serving.grpc", ["fastgen.serving.limits", "fastgen.serving.admission", "fastgen.serving.backend",
                              *PUBLIC]),
    ("fastgen.serving.lora", [*PUBLIC]),
    ("fastgen.serving.http", ["fastgen.serving.limits", "fastgen.serving.admission", "fastgen.serving.metrics",
                              "fastgen.serving.backend", "fastgen.serving.lora", *PUBLIC]),
    # Chat completions' messages, tools, tool-call and reasoning parsers and reply shaping sit under the
    # routes: they raise the guard's 400s and know nothing of the routes, the gateway or the engine.
    ("fastgen.serving.http.chat", ["fastgen.serving.http.guard"]),
]
LAZY_OK = {"fastgen.__init__": ["fastgen.serving."], "fastgen.api": ["fastgen.executor."]}
"""Imports allowed inside functions only (they run when called, not when the module loads)."""


def _modules():
    """(module name, path) of every source file; fastgen's own `__init__` is "fastgen.__init__" so the
    public package gets its own rules."""
    for folder, package in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "proto" in dirpath.split(os.sep) or "__pycache__" in dirpath:
                continue
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
                module = f"{package}.{rel}"
                if module != "fastgen.__init__":
                    module = module.removesuffix(".__init__")
                yield module, path


def _imports(path):
    """(line, imported module, inside a function or TYPE_CHECKING block) for each fastgen import."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = []

    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and \
                    child.module.split(".")[0] == "fastgen":
                out.append((child.lineno, child.module, inner))
            elif isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, inner) for a in child.names if a.name.split(".")[0] == "fastgen")
            visit(child, inner)

    visit(tree, False)
    return out


def _allowed(target: str, rules: list[str]) -> bool:
    return any(target.startswith(r) or target == r.rstrip(".") if r.endswith(".") else target == r for r in rules)


def _rules(module: str):
    matches = [(prefix, rules) for prefix, rules in ALLOWED if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} belongs to no layer: add it to ALLOWED"
    return max(matches, key=lambda m: len(m[0]))


MODULES = sorted(_modules())


@pytest.mark.parametrize("module, path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down(module, path):
    prefix, rules = _rules(module)
    bad = []
    for line, target, lazy in _imports(path):
        if target == module or _allowed(target, rules + [prefix + "."]):
            continue
        if lazy and _allowed(target, LAZY_OK.get(prefix, [])):
            continue
        bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target}")
    assert not bad, "imports pointing up the layers:\n" + "\n".join(bad)


def test_the_check_sees_every_layer_and_catches_an_upward_import(tmp_path):
    assert {_rules(m)[0] for m, _ in MODULES} >= {"fastgen.ops", "fastgen.models", "fastgen.planning",
                                                  "fastgen.executor", "fastgen.engine", "fastgen.serving"}
    upward = tmp_path / "bad.py"
    upward.write_text("from fastgen.engine.engine import Engine\n\ndef f():\n    import fastgen.serving.http.app\n")
    found = _imports(str(upward))
    assert found == [(1, "fastgen.engine.engine", False), (4, "fastgen.serving.http.app", True)]
    assert not _allowed("fastgen.engine.engine", _rules("fastgen.executor.runner")[1])
    assert not _allowed("fastgen.engine.loop", _rules("fastgen.serving.http.app")[1])
    assert _allowed("fastgen.engine", _rules("fastgen.serving.http.app")[1])
    assert not _allowed("fastgen.serving.grpc.server", _rules("fastgen.serving.http.app")[1])
    assert not _allowed("fastgen.serving.deploy.launcher", _rules("fastgen.serving.grpc.server")[1])
    assert not _allowed("fastgen.serving.http.gateway", _rules("fastgen.serving.http.chat.output")[1])
    assert _allowed("fastgen.serving.http.guard", _rules("fastgen.serving.http.chat.tools")[1])


def test_top_level_stays_small():
    top = [n for n in os.listdir(os.path.join(ROOT, "fastgen")) if n.endswith(".py")]
    assert len(top) <= 8, f"fastgen/ holds {len(top)} modules at its top level: {sorted(top)}"
