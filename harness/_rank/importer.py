"""Imports a test module inside a rank the way pytest imported it in the parent."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import sys
import types

from _pytest.assertion.rewrite import rewrite_asserts


class _AssertRewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles a test module with pytest's assertion rewriting, so that a plain
    ``assert`` failing on a rank explains itself as it would in the parent."""

    def source_to_code(self, data, path, *, _optimize=-1):  # type: ignore[override]
        tree = ast.parse(data, filename=path)
        rewrite_asserts(tree, bytes(data), str(path), None)
        return compile(tree, path, "exec", dont_inherit=True)

    def get_code(self, fullname: str) -> types.CodeType:  # no bytecode cache
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


def import_test_module(name: str, file: str, rewrite_asserts: bool) -> types.ModuleType:
    existing = sys.modules.get(name)
    if existing is not None and _same_file(getattr(existing, "__file__", None), file):
        return existing
    loader = _AssertRewritingLoader(name, file) if rewrite_asserts else None
    spec = importlib.util.spec_from_file_location(name, file, loader=loader)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import test module {name!r} from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _same_file(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def resolve_qualname(module: types.ModuleType, qualname: str) -> type:
    obj: object = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{module.__name__}.{qualname} is not a class")
    return obj
