"""Package discovery; everything else is declared in pyproject.toml.

Packages are found, never listed, so a new subpackage cannot be left out of
the wheel. The plugin's folder `tensorboard_plugin/` installs under the
import name `tensorboard_plugin_mpprof` (TensorBoard loads plugins by entry
point, and a generic top-level name would clash): pyproject's
`packages.find` cannot apply such a mapping, so it is applied here.
Namespace discovery takes the `static/` folders as the packages holding the
static files, which `package-data` ships.
"""

from setuptools import find_namespace_packages, setup

PLUGIN = "tensorboard_plugin_mpprof"
PLUGIN_DIR = "tensorboard_plugin"


def _found(top: str) -> list[str]:
    return find_namespace_packages(include=[top, f"{top}.*"], exclude=["*.__pycache__"])


setup(
    packages=_found("mpprof") + [PLUGIN + name[len(PLUGIN_DIR):] for name in _found(PLUGIN_DIR)],
    package_dir={PLUGIN: PLUGIN_DIR},
)
