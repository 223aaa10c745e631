"""The README's and docs/'s Python examples run as written.

Every fenced ```python block of README.md and docs/*.md runs in its own
process, in a temporary directory (they write `logs/`), unless the line before
its fence is a `<!-- not-run: reason -->` comment: a fragment, or a block that
needs what a test machine lacks (a GPU trace, your own data).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from mpprof.records import reader

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```python\n(?P<code>.*?)^(?P=indent)```", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not-run: \S.* -->\s*$")


def _blocks():
    """(file, line, code, runnable) for each ```python block."""
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip("\n ").rsplit("\n", 1)[-1]
            indent = len(match["indent"])
            code = "".join(c[indent:] for c in match["code"].splitlines(keepends=True))
            yield path.relative_to(ROOT).as_posix(), line, code, not NOT_RUN.search(before)


BLOCKS = list(_blocks())
RUNNABLE = [b for b in BLOCKS if b[3]]


def _is_quick_start(file: str, code: str) -> bool:
    return file == "README.md" and "MixedPrecisionProfiler(" in code


def test_the_quick_start_is_run_and_fragments_say_why():
    assert any(_is_quick_start(file, code) for file, _, code, _ in RUNNABLE)
    # A not-run marker must give a reason (the regex requires one); and no
    # more than a few blocks may opt out, or the test would check little.
    assert len(BLOCKS) - len(RUNNABLE) <= 3, [(f, n) for f, n, _, r in BLOCKS if not r]


@pytest.mark.parametrize(("file", "line", "code"), [b[:3] for b in RUNNABLE],
                         ids=[f"{b[0]}:{b[1]}" for b in RUNNABLE])
def test_example_runs(file, line, code, tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{file}:{line}\n{result.stderr[-3000:]}"
    if _is_quick_start(file, code) or "MixedPrecisionProfiler(" in code:
        # What the example recorded reads back: the fit ended, with its
        # inventory and loss scale.
        runs = reader.read_logdir(tmp_path / "logs")
        assert list(runs) == ["run1/train"]
        run = runs["run1/train"]
        assert not run.cut_short
        assert run.context["fit_state"] == "ended"
        assert [layer["name"] for layer in run.inventory["layers"]][-2:] == ["dense", "dense_1"]


def test_the_readme_starts_with_the_install_then_the_callback_then_make():
    """A reader who will `pip install` sees how first, then the lines that add
    the callback (with KERAS_BACKEND said), then the checkout's two commands."""
    text = (ROOT / "README.md").read_text()
    first_fence = text.index("```")
    assert text[first_fence:].startswith("```bash\npip install \".[jax]\"")
    first_python = FENCE.search(text)
    code = [line for line in first_python["code"].splitlines() if line.strip()]
    assert len(code) <= 3 and "MixedPrecisionProfiler(" in code[-1]
    assert "KERAS_BACKEND" in text[:first_python.start()]
    # `make demo` and `make test` stay near the top, after the callback.
    for command in ("make demo", "make test"):
        assert first_python.end() < text.index(command) < 3000


def test_getting_started_says_how_to_install():
    text = (ROOT / "docs" / "index.md").read_text()
    install = text.index("## Install")
    assert install < text.index("## Quick start")
    assert 'pip install ".[jax]"' in text[install:] and "KERAS_BACKEND" in text[install:]


def test_measured_figures_have_one_home():
    """Ratios measured by a benchmark are quoted in docs/performance.md only;
    the README and Getting started link there (two copies drift apart)."""
    ratio = re.compile(r"\b\d\.\d{2,3}(?:-\d\.\d{2,3})?x\b")
    for path in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        text = path.read_text()
        assert not ratio.findall(text), (path.name, ratio.findall(text))
    assert "(docs/performance.md)" in (ROOT / "README.md").read_text()
    assert ratio.findall((ROOT / "docs" / "performance.md").read_text())
