"""docs/architecture.md lists every module of mpprof and of the plugin, and
only modules that exist (its "## The folders" block)."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "architecture.md")
# One name in the names column: a module or a folder.
_NAME = re.compile(r"^(?:\w+\.py|\w+/)$")


def listed_paths() -> tuple[set[str], set[str]]:
    """(modules, folders) the folders block names, as paths from the root.

    A line's names column is what comes before its first gap of two spaces;
    it names modules (comma-separated) or one folder. Its indent says which
    folder it belongs to; a line whose first column is not names is a
    description.
    """
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    block = text.split("## The folders", 1)[1].split("```", 2)[1]
    modules, folders = set(), set()
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names = [n.strip() for n in column.split(",") if n.strip()]
        if not names or not all(_NAME.match(n) for n in names):
            continue  # a description's continuation
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        for name in names:
            path = parent + name
            if name.endswith("/"):
                folders.add(path)
                stack.append((indent, path))
            else:
                modules.add(path)
    return modules, folders


def code_modules() -> set[str]:
    """Every module of mpprof/ and tensorboard_plugin/, but an `__init__.py`
    holding only a docstring."""
    found = set()
    for top in ("mpprof", "tensorboard_plugin"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "static")]
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                if name == "__init__.py" and _docstring_only(path):
                    continue
                found.add(os.path.relpath(path, ROOT).replace(os.sep, "/"))
    return found


def _docstring_only(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        body = ast.parse(f.read()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def test_every_module_listed_exists_and_every_module_is_listed():
    modules, folders = listed_paths()
    code = code_modules()
    assert sorted(modules - code) == [], "listed in docs/architecture.md, not in the code"
    assert sorted(code - modules) == [], "in the code, not listed in docs/architecture.md"
    assert [f for f in sorted(folders) if not os.path.isdir(os.path.join(ROOT, f))] == []


def test_the_parser_reads_folders_and_descriptions_apart():
    """The look-alikes that must not count: description lines, and a module
    named in a description (it belongs to no folder there)."""
    modules, folders = listed_paths()
    assert "mpprof/backends/jax/step_state.py" in modules
    assert "mpprof/backends/tensorflow/" in folders and "mpprof/backends/jax/" in folders
    assert "mpprof/backends/kernels.py" not in modules  # named in a description only
    assert not any(" " in m for m in modules)
