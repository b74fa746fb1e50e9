"""`EngineConfig` as type checkers see it (the `TYPE_CHECKING` class in `fastgen/config.py`) is the class
the module builds at run time: the same plan fields, in order, each with its declaration's annotation."""

import ast
import dataclasses
import os

import fastgen.config
from fastgen.config import EngineConfig, _EngineOptions
from fastgen.planning.plan import PLAN_FIELDS, PLAN_SPECS


def _checker_fields() -> dict[str, str]:
    tree = ast.parse(open(fastgen.config.__file__, encoding="utf-8").read())
    guard = next(node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    cls = next(node for node in guard.body if isinstance(node, ast.ClassDef) and node.name == "EngineConfig")
    return {node.target.id: ast.unparse(node.annotation) for node in cls.body if isinstance(node, ast.AnnAssign)}


def test_the_checkers_view_declares_every_plan_field_as_the_plan_does():
    declared = _checker_fields()
    assert list(declared) == list(PLAN_FIELDS)
    assert declared == {name: spec.metadata["option"] for name, spec in PLAN_SPECS.items()}


def test_the_runtime_class_has_the_options_then_the_plan_fields():
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert names == [f.name for f in dataclasses.fields(_EngineOptions)] + list(PLAN_FIELDS)
    assert EngineConfig.__module__ == "fastgen.config" and os.path.basename(fastgen.config.__file__) == "config.py"
    config = EngineConfig(model="m", token_budget=64)
    assert config.plan_overrides()["token_budget"] == 64 and config.plan_overrides()["compile"] is None
