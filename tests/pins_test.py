"""constraints.txt (issue 52): the suite runs with exactly the pinned versions, every pin
admits setup.py's lowest Python, and the pods page installs what the pins say."""

import importlib.metadata as md
import os
import re

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pins() -> dict[str, str]:
    pins = {}
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, version = line.split("==")
                pins[name.strip()] = version.strip()
    return pins


def _python_requires() -> str:
    with open(os.path.join(ROOT, "setup.py")) as f:
        return re.search(r'python_requires="([^"]+)"', f.read()).group(1)


def test_every_pin_is_exact_and_the_core_stack_is_pinned():
    pins = _pins()
    assert all(re.fullmatch(r"[\w.+]+", v) for v in pins.values()), pins
    for name in ("jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint", "tensorstore"):
        assert name in pins, f"constraints.txt does not pin {name}"


def test_the_installed_versions_are_the_pinned_ones():
    wrong = []
    for name, version in _pins().items():
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            continue  # an extra this venv lacks (libtpu outside the test venv)
        if Version(installed).public != Version(version).public:
            wrong.append(f"{name} {installed} (pinned {version})")
    assert not wrong, f"this venv differs from constraints.txt: {wrong}; run `make install-test`"


def test_python_requires_admits_every_pin_and_no_older_python():
    lowest = SpecifierSet(_python_requires())
    floor = re.fullmatch(r">=\s*(\d+\.\d+)", _python_requires()).group(1)
    too_new = []
    for name in _pins():
        try:
            needs = md.metadata(name).get("Requires-Python") or ""
        except md.PackageNotFoundError:
            continue
        if needs and not SpecifierSet(needs).contains(floor):
            too_new.append(f"{name} needs Python {needs}")
    assert not too_new, f"setup.py says python_requires={lowest}, but {too_new}"
    # ... and the floor is the pins' own: jax 0.10 needs 3.11, so 3.10 would not install.
    assert not SpecifierSet(md.metadata("jax")["Requires-Python"]).contains("3.10")
    assert floor == "3.11"


def test_the_pods_page_installs_with_the_constraints_and_a_python_they_admit():
    with open(os.path.join(ROOT, "docs", "pods.md")) as f:
        text = f.read()
    assert "-c constraints.txt" in text or "make install-tpu" in text
    versions = re.findall(r"uv (?:python install|python find) (\d+\.\d+)", text)
    assert versions and all(SpecifierSet(_python_requires()).contains(v) for v in versions)
    pins, named = _pins(), 0
    for name, version in re.findall(r"([a-z][\w-]*) (\d+\.\d+\.\d+(?:\.\d+)?)\b", text):
        if name in pins:  # a version the page names is the pinned one
            assert version == pins[name], f"docs/pods.md says {name} {version}, pinned {pins[name]}"
            named += 1
    assert named >= 4
