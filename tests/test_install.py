"""The accelerator extras pull jax's own wheels at the pinned jax, and the README names them.

Resolution is read from the installed jax's metadata (the tier runs on the pinned jax:
the first test checks that), so nothing is downloaded or installed. ``pip install
--dry-run --ignore-installed -c requirements/constraints.txt ".[cuda13]"`` resolves
the same way where a package index is at hand.
"""

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
ACCELERATORS = ("cuda12", "cuda13", "tpu")


def pins() -> dict[str, str]:
    """``requirements/constraints.txt`` as ``{canonical name: version}``."""
    found = {}
    for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            found[canonicalize_name(name)] = version.strip()
    return found


def extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]


def test_the_installed_jax_is_the_pinned_one():
    assert importlib.metadata.version("jax") == pins()["jax"]


@pytest.mark.parametrize("extra", ACCELERATORS)
def test_an_accelerator_extra_pulls_jax_s_wheels_at_the_pinned_jax(extra):
    pinned = pins()
    (requirement,) = map(Requirement, extras()[extra])
    assert canonicalize_name(requirement.name) == "jax" and len(requirement.extras) == 1
    assert requirement.specifier.contains(pinned["jax"])
    (jax_extra,) = requirement.extras
    metadata = importlib.metadata.metadata("jax")
    assert jax_extra in metadata.get_all("Provides-Extra")
    pulled = [
        r
        for r in map(Requirement, metadata.get_all("Requires-Dist"))
        if r.marker is not None and r.marker.evaluate({"extra": jax_extra})
    ]
    accelerator = [r for r in pulled if canonicalize_name(r.name) not in ("jaxlib", "requests")]
    assert accelerator, f"jax[{jax_extra}] pulls no accelerator package"
    for r in pulled:  # none contradicts a pin
        name = canonicalize_name(r.name)
        if name in pinned:
            assert r.specifier.contains(pinned[name]), (r, pinned[name])
        if name == "jaxlib" or name.startswith("jax-"):  # jax's own wheels: jax's version
            assert r.specifier.contains(pinned["jax"]), r


def test_the_readme_s_first_screen_names_each_extra_and_what_to_run_first():
    readme = (ROOT / "README.md").read_text()
    first = readme[: readme.index("## A short tour")]
    for extra in ACCELERATORS:
        assert re.search(rf"\[{extra}\]", first), extra
    assert "bench/gpu.py" in first and "bench/device.py" in first
