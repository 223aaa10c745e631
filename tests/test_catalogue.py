"""docs/findings.md and the README's table against the rule registry, and the
registry's own rules: each code declared once, with a known view."""

import pathlib
import re

from mpprof import diagnosis
from mpprof.backends import REGISTRY

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if re.fullmatch(r"MP\d{3}", cells[0]):
            rows.setdefault(cells[0], cells)
    return rows


def test_docs_table_is_the_registry():
    text = (ROOT / "docs" / "findings.md").read_text()
    rows = _table_rows(text)
    assert list(rows) == list(diagnosis.CATALOGUE)
    for code, rule in diagnosis.CATALOGUE.items():
        assert rows[code] == [code, rule.severity, rule.title, rule.data, rule.view]


def test_docs_have_a_section_per_rule_with_its_severity():
    text = (ROOT / "docs" / "findings.md").read_text()
    sections = dict(re.findall(r"^## (MP\d{3}) (critical|warning|info):", text, re.M))
    assert sections == {code: r.severity for code, r in diagnosis.CATALOGUE.items()}


def test_readme_table_lists_every_rule_with_its_severity():
    rows = _table_rows((ROOT / "README.md").read_text())
    assert {code: cells[1] for code, cells in rows.items()} == {
        code: rule.severity for code, rule in diagnosis.CATALOGUE.items()
    }


def test_every_rule_is_declared_once_with_a_view_and_a_doc():
    for code, rule in diagnosis.CATALOGUE.items():
        assert rule.view in diagnosis.VIEWS and rule.severity in diagnosis.SEVERITIES
        assert rule.doc and rule.judge.__doc__, code
    # Only hardware rules apply to a worker's own run.
    assert {c for c, r in diagnosis.CATALOGUE.items() if r.host} == {"MP010", "MP011"}


def test_the_diagnosis_imports_no_tensorflow():
    """The judge reads records only: a CLI or plugin that diagnoses a logdir
    need not pay TensorFlow's import. (mpprof/__init__ imports the callback,
    which does; it is stubbed here to look at the diagnosis alone.) Nor does
    spelling a fix for any backend: the registry and every backend's row
    (`fix_spelling.py`), which `FixSyntax` loads, import no framework."""
    import subprocess
    import sys

    code = (
        "import sys, types\n"
        "stub = types.ModuleType('mpprof.recording.callback'); stub.MixedPrecisionProfiler = None\n"
        "sys.modules['mpprof.recording.callback'] = stub\n"
        "import mpprof.diagnosis\n"
        "print(sorted({'tensorflow', 'keras', 'tf_keras'} & set(sys.modules)))\n"
        "from mpprof.backends import REGISTRY\n"
        "from mpprof.fix_syntax import FixSyntax\n"
        "texts = [FixSyntax(flavor, name).custom_step()\n"
        "         for flavor in ('keras', 'tf_keras') for name in REGISTRY]\n"
        "frameworks = ('tensorflow', 'keras', 'tf_keras', 'jax', 'torch')\n"
        "print(len(set(texts)), sorted(m for m in sys.modules if m.split('.')[0] in frameworks))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    diagnosis_loaded, spelling = result.stdout.strip().splitlines()
    assert diagnosis_loaded == "[]"
    # Every Keras 3 backend's step and tf-keras' (one row), none loading a framework.
    assert spelling == f"{len(REGISTRY) + 1} []"
