"""mpprof installed as users install it: a wheel built from the sdist.

The suite otherwise runs against the editable install, which serves every
file of the source tree, listed in the wheel or not. Here the sdist and the
wheel are built with `python -m build` (the wheel from the sdist, as pip
builds one from an index), the wheel's files are compared with the source
tree's, and the wheel is installed into a new virtual environment that sees
the test environment's dependencies (TensorFlow is not installed twice) but
neither the source tree nor the editable install. From a directory outside
the tree, that installation trains a few steps with the callback (a layer
that overflows float16, so a step is captured), runs every CLI command on
what was recorded (`--version`, `summary`, `diagnose`, `replay`, `bundle`,
`report`) and serves the TensorBoard tab through its entry point.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile

import pytest

import mpprof

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source folder -> the import name it installs under.
PACKAGES = {"mpprof": "mpprof", "tensorboard_plugin": "tensorboard_plugin_mpprof"}


def _source_files() -> set[str]:
    """Every file of the packages' folders, by its path in an installation."""
    found = set()
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                found.add(f"{name}/{path.relative_to(ROOT / folder).as_posix()}")
    return found


def _checkout(destination: pathlib.Path) -> pathlib.Path:
    """The project's files as `git clone` (or `pip install git+...`) gets
    them: the source tree's own build leftovers (the editable install's
    `mpprof.egg-info`, whose file list setuptools reuses) would otherwise
    put files into the sdist that its configuration leaves out."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a file deleted but not yet committed is not
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    source = _checkout(tmp_path_factory.mktemp("checkout"))
    # No isolation: the build backend comes from the test environment
    # (setuptools>=68, a dev dependency) instead of a download per run.
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # setuptools says "Package would be ignored" and the like as warnings.
    assert "BuildBackendWarning" not in result.stderr, result.stderr
    assert "SetuptoolsDeprecationWarning" not in result.stderr, result.stderr
    return out


def _wheel(dist: pathlib.Path) -> pathlib.Path:
    (wheel,) = dist.glob("mpprof-*.whl")
    return wheel


def test_wheel_holds_every_file_of_the_source_tree(dist):
    names = set(zipfile.ZipFile(_wheel(dist)).namelist())
    installed = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert installed == _source_files()
    assert _wheel(dist).name == f"mpprof-{mpprof.__version__}-py3-none-any.whl"
    entry_points = zipfile.ZipFile(_wheel(dist)).read(
        f"mpprof-{mpprof.__version__}.dist-info/entry_points.txt").decode()
    assert "mpprof = mpprof.cli:main" in entry_points
    assert "mpprof = tensorboard_plugin_mpprof.plugin:MpprofPluginLoader" in entry_points


def test_sdist_holds_what_the_wheel_is_built_from(dist):
    (sdist,) = dist.glob("mpprof-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    expected = {f"{folder}/{path.split('/', 1)[1]}" for path in _source_files()
                for folder, name in PACKAGES.items() if path.startswith(name + "/")}
    assert expected <= names
    assert {"pyproject.toml", "setup.py", "README.md"} <= names


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> pathlib.Path:
    """A virtual environment holding the wheel; its dependencies are the
    test environment's, seen through a path file that adds that environment's
    site-packages as a plain folder (so its own path files, the editable
    install's among them, are not run)."""
    home = tmp_path_factory.mktemp("wheel-env")
    venv.create(home, with_pip=False)
    env_python = home / "bin" / "python"
    purelib = subprocess.run(
        [str(env_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    dependencies = [p for p in site.getsitepackages() if pathlib.Path(p).is_dir()]
    pathlib.Path(purelib, "test_environment.pth").write_text("\n".join(dependencies) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env_python), "install", "--no-deps",
         "--no-index", "--quiet", str(_wheel(dist))],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return home


def _run(installed: pathlib.Path, cwd: pathlib.Path, *command: str, timeout: int = 300):
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    environment.update(PATH=f"{installed / 'bin'}{os.pathsep}{environment.get('PATH', '')}",
                       TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",
                       KERAS_BACKEND="tensorflow")
    return subprocess.run(list(command), cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=timeout)


TRAIN = textwrap.dedent("""
    import json, pathlib, sys
    import keras, numpy as np
    import mpprof
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    # Ones through Dense(0.1) reach "big" at 1.6: its float16 MatMul with a
    # kernel of 5000 overflows (a capture for `mpprof replay` to re-run).
    model = keras.Sequential([
        keras.layers.Input((16,)), keras.layers.Dense(16, kernel_initializer=constant(0.1)),
        keras.layers.Dense(16, kernel_initializer=constant(5000.0), name="big"),
        keras.layers.Dense(1, kernel_initializer=constant(1e-6), dtype="float32")])
    # Adam at a tiny rate: the skipped steps leave the weights as initialised,
    # and verifying the fix trains 30 steps from them, in which float32 must
    # learn (tests/test_replay.py's _trial_optimizer).
    model.compile(optimizer=keras.optimizers.Adam(1e-9), loss="mse")
    model.fit(np.ones((64, 16), np.float32), np.ones((64, 1), np.float32), batch_size=16,
              epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(sys.argv[1], numerics_every=2)])
    print(json.dumps({"mpprof": mpprof.__file__,
                      "steps": int(model.optimizer.iterations.numpy())}))
""")

SERVE = textwrap.dedent("""
    import importlib.metadata, json, sys
    from tensorboard.plugins import base_plugin
    from werkzeug import test
    (entry,) = [ep for ep in importlib.metadata.entry_points(group="tensorboard_plugins")
                if ep.name == "mpprof"]
    plugin = entry.load()().load(base_plugin.TBContext(logdir=sys.argv[1]))
    apps = plugin.get_plugin_apps()
    runs = test.Client(apps["/runs"]).get("/runs")
    # The tab's own module, a static file of the wheel.
    module = test.Client(apps["/index.js"]).get("/index.js")
    import tensorboard_plugin_mpprof, mpprof
    print(json.dumps({"status": [runs.status_code, module.status_code],
                      "runs": json.loads(runs.get_data())["runs"],
                      "module_bytes": len(module.get_data()),
                      "files": [tensorboard_plugin_mpprof.__file__, mpprof.__file__]}))
""")


def test_installed_wheel_records_a_fit_and_serves_it(installed, tmp_path):
    outside = tmp_path / "elsewhere"  # not the source tree: nothing there to import
    outside.mkdir()
    site_packages = str(installed)

    version = _run(installed, outside, "mpprof", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"mpprof {mpprof.__version__}"

    trained = _run(installed, outside, str(installed / "bin" / "python"), "-c", TRAIN, "logs")
    assert trained.returncode == 0, trained.stderr[-4000:]
    facts = json.loads(trained.stdout.splitlines()[-1])
    # Every step overflowed and was skipped: iterations never moved.
    assert facts["mpprof"].startswith(site_packages) and facts["steps"] == 0

    summary = _run(installed, outside, "mpprof", "summary", "logs")
    assert summary.returncode == 0 and "4 overflows" in summary.stdout, summary.stderr
    diagnosed = _run(installed, outside, "mpprof", "diagnose", "logs", "--format", "json")
    assert diagnosed.returncode == 0, diagnosed.stderr
    found = {(f["code"], f["layer"]) for f in json.loads(diagnosed.stdout)}
    assert ("MP003", "big") in found and ("MP011", None) in found
    replayed = _run(installed, outside, "mpprof", "replay", "logs", "--format", "json")
    assert replayed.returncode == 0, replayed.stderr[-4000:]
    result = json.loads(replayed.stdout)
    assert result["first_op"]["layer"] == "big"
    assert result["verified"] is True, result["verified_detail"]
    bundled = _run(installed, outside, "mpprof", "bundle", "logs", "-o", "repro.zip")
    assert bundled.returncode == 0 and zipfile.is_zipfile(outside / "repro.zip"), bundled.stderr

    report = _run(installed, outside, "mpprof", "report", "logs", "-o", "report.html", "-q")
    assert report.returncode == 0, report.stderr
    assert "mpprof" in (outside / "report.html").read_text()

    served = _run(installed, outside, str(installed / "bin" / "python"), "-c", SERVE, "logs")
    assert served.returncode == 0, served.stderr[-4000:]
    answer = json.loads(served.stdout.splitlines()[-1])
    assert answer["status"] == [200, 200]
    assert [run["run"] for run in answer["runs"]] == ["train"]
    assert answer["module_bytes"] == len((ROOT / "tensorboard_plugin/static/index.js").read_bytes())
    assert all(path.startswith(site_packages) for path in answer["files"])


# ---------------------------------------------------------------- packaging


def _metadata(dist: pathlib.Path) -> str:
    return zipfile.ZipFile(_wheel(dist)).read(
        f"mpprof-{mpprof.__version__}.dist-info/METADATA").decode()


def test_the_license_is_in_the_repository_the_sdist_and_the_wheel(dist):
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    (sdist,) = dist.glob("mpprof-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert "LICENSE" in names
    wheel_names = zipfile.ZipFile(_wheel(dist)).namelist()
    assert f"mpprof-{mpprof.__version__}.dist-info/licenses/LICENSE" in wheel_names
    metadata = _metadata(dist)
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata


def test_the_metadata_says_what_mpprof_is_for(dist):
    metadata = _metadata(dist)
    classifiers = {line.split(": ", 1)[1] for line in metadata.splitlines()
                   if line.startswith("Classifier: ")}
    assert {"Programming Language :: Python :: 3.10", "Programming Language :: Python :: 3.13",
            "Topic :: Scientific/Engineering :: Artificial Intelligence",
            "Framework :: Jupyter", "Operating System :: POSIX :: Linux"} <= classifiers
    assert "Requires-Python: >=3.10" in metadata


def test_the_sdist_holds_no_half_test_suite(dist):
    """The tests need the repository (examples, docs, benchmarks, real
    training, Chromium): the sdist holds none rather than some."""
    (sdist,) = dist.glob("mpprof-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert not {n for n in names if n.startswith("tests/")}


def test_the_package_page_has_no_relative_link_or_image(dist):
    """A package index shows the README without the repository's files:
    links into the repository become text naming the file (there is no
    public repository URL to point them at yet), images go."""
    description = _metadata(dist).split("\n\n", 1)[1]
    assert description.startswith("# mpprof")
    assert "Content-Type: text/markdown" in _metadata(dist)
    assert "](docs/" not in description and "](CHANGELOG.md" not in description
    assert "![" not in description
    # The link's text stays, with where to find it.
    assert "[docs/findings.md](docs/findings.md)" in (ROOT / "README.md").read_text()
    assert "docs/findings.md (in the source repository)" in description
    # Links within the page still work there.
    assert "](#install)" in description


@pytest.mark.parametrize("constraints, extras", [
    ("constraints-jax.txt", ("jax",)), ("constraints-tensorflow.txt", ("tensorflow", "tf-keras"))])
def test_the_lowest_versions_checked_are_the_lower_bounds(constraints, extras):
    """`make test-lowest` installs tests/lowest/constraints-*.txt: each pin
    must be the lower bound pyproject.toml declares for the base or the
    extras that file installs, or the check proves nothing about the bounds
    users get."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    bounds = {}
    for requirement in requirements:
        name, _, lowest = requirement.partition(">=")
        bounds[name.split("[")[0].strip().lower()] = lowest.strip()
    pins = {}
    for line in (ROOT / "tests" / "lowest" / constraints).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    for name, lowest in bounds.items():
        assert name in pins, f"{name} is not pinned to its lower bound"
        if name == "fsspec":  # xprof, in both extras, asks for a later one
            continue
        # "3.9" allows 3.9.0; "2.16.2" is 2.16.2.
        assert pins[name] == lowest or pins[name] == lowest + ".0", (name, pins[name], lowest)
    if "jax" in pins:
        assert pins["jaxlib"] == pins["jax"]
