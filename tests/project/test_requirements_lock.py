"""requirements.lock: every environment of this repo installs the tested versions, on any day.

The lock is made by `make lock` (pip-tools' pip-compile) from pyproject.toml's loose ranges; the Makefile
installs through tools/install.sh with ``pip install -c requirements.lock``. These tests compare the lock
with pyproject and with the running environment, and run the install script against a recording
stand-in for the venv's python, so a Makefile that stopped using the lock fails here.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
            assert m, f"requirements.lock: {line!r} is not name==version (run `make lock`)"
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def project_requirements() -> list[Requirement]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(d) for d in meta["dependencies"]]
    for deps in meta["optional-dependencies"].values():
        reqs += [Requirement(d) for d in deps]
    return reqs


def test_lock_pins_every_dependency_of_every_extra_within_pyprojects_ranges():
    pins = lock_pins()
    for req in project_requirements():
        name = _norm(req.name)
        assert name in pins, f"requirements.lock lacks {req.name} (pyproject.toml: {req}); run `make lock`"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), (
            f"requirements.lock pins {name}=={pins[name]}, outside pyproject.toml's {req}; run `make lock`")


def test_pyproject_ranges_stay_loose():
    """A library must not pin its users: exact pins belong in the lock only."""
    for req in project_requirements():
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"pyproject.toml pins {req}"


def test_the_environment_running_the_tests_is_the_lock():
    differ = {}
    for name, version in lock_pins().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or Version(installed) != Version(version):
            differ[name] = (version, installed)
    assert not differ, (f"installed versions differ from requirements.lock (locked, installed): {differ}; "
                        "`make test` installs the lock (tools/install.sh); rerun it or remove .venv")


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python records its arguments instead of installing anything."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    py.chmod(0o755)
    return venv, log


def _install(venv: Path, extras: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, VENV=str(venv), PYTHON="false")
    return subprocess.run(["sh", "tools/install.sh", extras], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_install_script_installs_through_the_lock_and_only_what_is_missing(tmp_path):
    venv, log = _fake_venv(tmp_path)
    assert _install(venv, "pipeline").returncode == 0
    calls = log.read_text().splitlines()
    assert calls[-1] == "-m pip install -c requirements.lock -e .[pipeline]", calls
    assert calls[0].startswith("-m pip install -q pip==")
    log.write_text("")
    assert _install(venv, "pipeline").returncode == 0
    assert log.read_text() == "", "a covered request must install nothing"
    r = _install(venv, "test,pipeline,jax")
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines()[-1] == "-m pip install -c requirements.lock -e .[jax,pipeline,test]"
    log.write_text("")
    assert _install(venv, "jax").returncode == 0 and log.read_text() == ""


def test_makefile_targets_install_through_the_script():
    text = (ROOT / "Makefile").read_text()
    for target, extras in (("demo", "$(DEMO_EXTRAS)"), ("test", "$(ALL_EXTRAS)"), ("bench", "$(ALL_EXTRAS)")):
        body = text.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
        assert f"$(INSTALL) {extras}" in body, (target, body)
    assert "INSTALL := VENV=$(VENV) PYTHON=$(PYTHON) sh tools/install.sh" in text
    demo = re.search(r"^DEMO_EXTRAS\s*:=\s*(\S+)", text, re.M).group(1)
    assert demo == "pipeline", "make demo installs only what the demo needs"
    all_extras = set(re.search(r"^ALL_EXTRAS\s*:=\s*(\S+)", text, re.M).group(1).split(","))
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all_extras == set(meta) - {"dataflow"}, "make test installs every extra but Dataflow's (test has it)"
