"""Package discovery; everything else is declared in pyproject.toml.

Packages are found, never listed, so a new subpackage cannot be left out of
the wheel. The plugin's folder `tensorboard_plugin/` installs under the
import name `tensorboard_plugin_mpprof` (TensorBoard loads plugins by entry
point, and a generic top-level name would clash): pyproject's
`packages.find` cannot apply such a mapping, so it is applied here.
Namespace discovery takes the `static/` folders as the packages holding the
static files, which `package-data` ships.

The long description is README.md made fit for a package index page, which
shows it without the repository's files: a link to a file of the repository
becomes its text and the file's name, an image goes (or both point into
REPOSITORY, once there is a public one).
"""

import pathlib
import re

from setuptools import find_namespace_packages, setup

PLUGIN = "tensorboard_plugin_mpprof"
PLUGIN_DIR = "tensorboard_plugin"
# The public repository's URL ("https://.../mpprof"): None until there is one.
REPOSITORY = None
# A markdown link or image whose target is relative (no scheme, not "#...").
_RELATIVE = re.compile(r"(?P<image>!?)\[(?P<text>[^\]]*)\]\((?P<target>(?![a-z]+:|#)[^)\s]+)\)")


def _index_link(match: re.Match) -> str:
    text, target = match["text"], match["target"]
    if REPOSITORY is not None:
        kind = "raw" if match["image"] else "blob"
        return f"{match['image']}[{text}]({REPOSITORY}/{kind}/main/{target})"
    if match["image"]:
        return ""
    if text == target.partition("#")[0]:
        return f"{text} (in the source repository)"
    return f"{text} ({target} in the source repository)"


def _found(top: str) -> list[str]:
    return find_namespace_packages(include=[top, f"{top}.*"], exclude=["*.__pycache__"])


def long_description() -> str:
    """README.md with its relative links made to work on a package index page."""
    readme = (pathlib.Path(__file__).parent / "README.md").read_text(encoding="utf-8")
    return _RELATIVE.sub(_index_link, readme)


setup(
    long_description=long_description(),
    long_description_content_type="text/markdown",
    packages=_found("mpprof") + [PLUGIN + name[len(PLUGIN_DIR):] for name in _found(PLUGIN_DIR)],
    package_dir={PLUGIN: PLUGIN_DIR},
)
