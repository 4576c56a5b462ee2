"""The cheap, deterministic parts of the release gate (``scripts/release_check.sh``): the version is
single-sourced, CHANGELOG.md follows Keep a Changelog, and the helpers of ``scripts/release_tools.py`` (changelog
checker, version readers, sdist re-packing, the skip-audit plugin and its verdict) catch what they exist for.

The gate itself (two builds, twine, the suite against the installed wheel) takes minutes and runs in CI
after the suite, not here.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib

import gefen
import gefen._version
from gefen.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def _load_release_tools():
    spec = importlib.util.spec_from_file_location("gefen_release_tools", ROOT / "scripts" / "release_tools.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


tools = _load_release_tools()


# ---------------------------------------------------------------------------------------- version sources
def test_version_is_single_sourced_in_version_py():
    assert gefen.__version__ is gefen._version.__version__
    assert tools.read_version_file(gefen._version.__file__) == gefen.__version__
    build_settings = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" in build_settings["project"]["dynamic"]
    assert "version" not in build_settings["project"]
    assert build_settings["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gefen._version.__version__"}


def test_installed_metadata_carries_the_version():
    assert importlib.metadata.version("gefen") == gefen.__version__


def test_cli_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"gefen {gefen.__version__}\n"


def test_changelog_is_well_formed_and_its_top_release_is_the_package_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert tools.check_changelog(text) == []
    entries = tools.parse_changelog(text)
    assert entries[0].version == "Unreleased"
    assert tools.top_released_version(text) == gefen.__version__


# ------------------------------------------------------------------------------------------ changelog checker
VALID = """# Changelog

Intro text before the first entry is free.

## [Unreleased]

### Added

- a feature that
  wraps onto a second line

## [1.1.0] - 2026-02-01

### Fixed

- a bug

## [1.0.0] - 2026-01-01

### Added

- the first release

[1.0.0]: https://example.invalid/1.0.0
"""


def test_changelog_checker_accepts_a_valid_changelog():
    assert tools.check_changelog(VALID) == []
    entries = tools.parse_changelog(VALID)
    assert [(e.version, e.date) for e in entries] == [
        ("Unreleased", None),
        ("1.1.0", "2026-02-01"),
        ("1.0.0", "2026-01-01"),
    ]
    assert entries[0].sections == {"Added": ["a feature that wraps onto a second line"]}
    assert tools.top_released_version(VALID) == "1.1.0"


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("# Changelog\n", "# Changes\n", "must start with the title '# Changelog'"),
        (VALID[VALID.index("## [Unreleased]") : VALID.index("## [1.1.0]")], "", "must be '## [Unreleased]'"),
        ("## [Unreleased]", "## [Unreleased] - 2026-03-01", "carries no date"),
        ("2026-02-01", "2026-02-30", "expected '## [X.Y.Z] - YYYY-MM-DD'"),
        ("## [1.1.0] - 2026-02-01", "## [1.1.0]", "expected '## [X.Y.Z] - YYYY-MM-DD'"),
        ("## [1.1.0]", "## [one.one]", "expected '## [X.Y.Z] - YYYY-MM-DD'"),
        ("## [1.1.0]", "## [0.9.0]", "[1.0.0] - 2026-01-01 must be older than the entry above it"),
        ("2026-01-01", "2026-03-01", "[1.0.0] - 2026-03-01 must be older than the entry above it"),
        ("## [1.1.0]", "## [1.0.0]", "version 1.0.0 appears twice"),
        ("### Fixed", "### Misc", "'### Misc' is not one of Added, Changed"),
        ("### Fixed\n\n- a bug", "### Fixed\n\n### Changed\n\n- a bug", "'### Fixed' of [1.1.0] has no '- ' items"),
        ("- the first release", "- the first release\n\n### Added\n\n- again", "'### Added (repeated)' is not one of"),
        ("- a bug", "a bug", "line 16: text outside a '- ' bullet"),
        ("### Fixed\n\n- a bug\n", "", "[1.1.0] lists no changes"),
    ],
)
def test_changelog_checker_names_each_problem(old, new, problem):
    assert old in VALID
    problems = tools.check_changelog(VALID.replace(old, new, 1))
    assert any(problem in p for p in problems), problems


def test_changelog_without_a_release_is_refused():
    text = VALID[: VALID.index("## [1.1.0]")]
    assert "no released '## [X.Y.Z] - YYYY-MM-DD' entry" in tools.check_changelog(text)
    with pytest.raises(ValueError, match="no released"):
        tools.top_released_version(text)


# -------------------------------------------------------------------------------------------- version readers
def test_read_version_file_reads_the_literal_without_importing(tmp_path):
    path = tmp_path / "_version.py"
    path.write_text('"""doc"""\nraise RuntimeError("never imported")\n__version__ = "1.2.3rc1"\n')
    assert tools.read_version_file(path) == "1.2.3rc1"
    for text in ["__version__ = compute()\n", 'VERSION = "1.0"\n', "__version__ = 1\n"]:
        path.write_text(text)
        with pytest.raises(ValueError, match="no top-level __version__"):
            tools.read_version_file(path)


def _metadata(version: str) -> bytes:
    return f"Metadata-Version: 2.4\nName: pkg\nVersion: {version}\nSummary: x\n\nLong description\n".encode()


def test_dist_version_reads_wheel_and_sdist_metadata(tmp_path):
    wheel = tmp_path / "pkg-1.2.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/__init__.py", "")
        archive.writestr("pkg-1.2.3.dist-info/METADATA", _metadata("1.2.3"))
    assert tools.dist_version(wheel) == "1.2.3"

    sdist = tmp_path / "pkg-4.5.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name, data in [("pkg-4.5/PKG-INFO", _metadata("4.5")), ("pkg-4.5/src/pkg.egg-info/PKG-INFO", b"")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    assert tools.dist_version(sdist) == "4.5"

    empty = tmp_path / "empty-1.0-py3-none-any.whl"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("pkg/__init__.py", "")
    with pytest.raises(ValueError, match="no single metadata file"):
        tools.dist_version(empty)
    with pytest.raises(ValueError, match="expected a .whl or .tar.gz"):
        tools.dist_version(tmp_path / "pkg.zip")


# ------------------------------------------------------------------------------------------------ sdist re-pack
def _sdist(path: Path, members: list[tuple[str, bytes | None, int]], *, mtime: int, owner: str) -> None:
    """Write a tar.gz with ``members`` = (name, data or None for a folder, mode) in the given order."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.mtime, info.mode, info.uname, info.uid = mtime, mode, owner, 1000
            if data is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    with open(path, "wb") as out, gzip.GzipFile(filename=path.name, mode="wb", fileobj=out, mtime=mtime) as packed:
        packed.write(raw.getvalue())


MEMBERS = [("p-1.0", None, 0o775), ("p-1.0/PKG-INFO", b"Version: 1.0\n", 0o664), ("p-1.0/run.sh", b"#!", 0o775)]


def test_normalize_sdist_depends_only_on_names_contents_and_exec_bits(tmp_path):
    first, second, other = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz", tmp_path / "c.tar.gz"
    _sdist(first, MEMBERS, mtime=1_700_000_000, owner="alice")
    _sdist(second, MEMBERS[::-1], mtime=1_800_000_123, owner="bob")
    _sdist(other, [*MEMBERS[:2], ("p-1.0/run.sh", b"#?", 0o775)], mtime=1_700_000_000, owner="alice")
    assert first.read_bytes() != second.read_bytes()
    for path in (first, second, other):
        tools.normalize_sdist(path, 1_234_567_890)
    assert first.read_bytes() == second.read_bytes()
    assert other.read_bytes() != first.read_bytes()
    assert first.read_bytes()[4:8] == b"\0\0\0\0"  # gzip header mtime
    with tarfile.open(first, "r:gz") as archive:
        members = archive.getmembers()
        assert [m.name for m in members] == ["p-1.0", "p-1.0/PKG-INFO", "p-1.0/run.sh"]
        assert [m.mode for m in members] == [0o755, 0o644, 0o755]
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(1_234_567_890, 0, 0, "", "")}
        assert archive.extractfile("p-1.0/run.sh").read() == b"#!"
    assert not list(tmp_path.glob("*.normalizing"))


def test_normalize_sdist_refuses_a_negative_epoch(tmp_path):
    path = tmp_path / "a.tar.gz"
    _sdist(path, MEMBERS, mtime=1, owner="x")
    before = path.read_bytes()
    with pytest.raises(ValueError, match="epoch=-1"):
        tools.normalize_sdist(path, -1)
    assert path.read_bytes() == before


# ---------------------------------------------------------------------------------------- the skip audit
PASSING_AUDIT = {
    "exitstatus": 0,
    "collected": 11,
    "gefen_items": 3,
    "gefen_file": "/venv/lib/python3.11/site-packages/gefen/__init__.py",
    "passed": 9,
    "failed": 0,
    "error": 0,
    "xfailed": 0,
    "xpassed": 0,
    "skipped": [
        {"nodeid": "tests/test_cuda.py::test_a", "reason": "needs a CUDA device", "cuda": True},
        {"nodeid": "tests/test_cuda.py::test_b", "reason": "needs a CUDA device", "cuda": True},
    ],
}


def _verdict(**changes):
    return tools.evaluate_audit({**PASSING_AUDIT, **changes}, forbidden_roots=["/repo/src"], require_package_items=True)


def test_audit_passes_a_clean_run_with_cuda_skips_only():
    verdict = _verdict()
    assert (verdict.ok, verdict.summary, verdict.problems) == (True, "9 passed, 0 failed, 2 skipped (cuda)", [])


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"exitstatus": 1}, "pytest exited with status 1"),
        ({"failed": 1}, "1 failed and 0 errors"),
        ({"error": 2}, "0 failed and 2 errors"),
        ({"xpassed": 1}, "1 tests marked xfail passed"),
        ({"passed": 0, "collected": 0}, "no test ran"),
        ({"skipped": [{"nodeid": "tests/x.py::t", "reason": "no model", "cuda": False}]}, "tests/x.py::t (no model)"),
        ({"gefen_file": "/repo/src/gefen/__init__.py"}, "inside /repo/src, not from the installed wheel"),
        ({"gefen_file": None}, "never imported gefen"),
        ({"gefen_items": 0}, "no doctest of the installed gefen package"),
    ],
)
def test_audit_refuses(changes, problem):
    verdict = _verdict(**changes)
    assert not verdict.ok
    assert any(problem in p for p in verdict.problems), verdict.problems


@pytest.mark.slow
def test_audit_plugin_records_outcomes_and_cuda_marks(tmp_path):
    """The real plugin in a real pytest run: one test of each outcome, a skip with and without the cuda mark."""
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "import gefen\n"
        "def test_pass(): assert gefen.__version__\n"
        "def test_fail(): assert False\n"
        "@pytest.mark.xfail(strict=True)\n"
        "def test_xfail(): assert False\n"
        "@pytest.mark.cuda\n"
        "@pytest.mark.skipif(True, reason='needs a GPU')\n"
        "def test_cuda(): pass\n"
        "def test_plain_skip(): pytest.skip('no data')\n"
    )
    audit_path = tmp_path / "audit.json"
    env = {**os.environ, "RELEASE_AUDIT_JSON": str(audit_path), "PYTHONPATH": str(ROOT / "scripts")}
    command = [sys.executable, "-m", "pytest", "-p", "release_tools", "-p", "no:cacheprovider", "-q", "-W", "ignore"]
    result = subprocess.run(
        [*command, "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stdout + result.stderr
    audit = json.loads(audit_path.read_text())
    counts = {key: audit[key] for key in ("exitstatus", "collected", "passed", "failed", "error", "xfailed", "xpassed")}
    assert counts == {"exitstatus": 1, "collected": 5, "passed": 1, "failed": 1, "error": 0, "xfailed": 1, "xpassed": 0}
    skipped = {s["nodeid"]: (s["cuda"], s["reason"]) for s in audit["skipped"]}
    assert skipped == {
        "test_sample.py::test_cuda": (True, "Skipped: needs a GPU"),
        "test_sample.py::test_plain_skip": (False, "Skipped: no data"),
    }
    assert Path(audit["gefen_file"]).resolve() == Path(gefen.__file__).resolve()
    verdict = tools.evaluate_audit(audit, forbidden_roots=[], require_package_items=False)
    assert verdict.summary == "1 passed, 1 failed, 1 skipped (cuda)"
    assert any("test_plain_skip (Skipped: no data)" in p for p in verdict.problems)
