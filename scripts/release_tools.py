"""Helpers of ``scripts/release_check.sh``: the checks of the release gate that are easier to get right (and to
test) in Python than in bash.

It owns four things, each usable from the command line (``python scripts/release_tools.py COMMAND ...``) and
from ``tests/test_release.py``:

* the **CHANGELOG format** (Keep a Changelog 1.1.0: ``## [Unreleased]`` first, then ``## [X.Y.Z] - YYYY-MM-DD``
  entries, newest first, with ``### Added/Changed/Deprecated/Removed/Fixed/Security`` lists) and its top released
  version;
* the **version** written in ``src/gefen/_version.py`` and the one recorded in a built wheel or sdist;
* a **byte-reproducible sdist**: setuptools writes the build time into the sdist (gzip header, ``PKG-INFO`` and
  ``*.egg-info`` mtimes), so the gate re-packs it with sorted members, one fixed mtime, owner 0 and a gzip header
  without name or time (the wheel needs nothing: setuptools already honours ``SOURCE_DATE_EPOCH`` there);
* a **pytest plugin** (``-p release_tools`` with this folder on ``PYTHONPATH``) that writes the run's outcome
  counts, every skipped test with its reason and whether it is marked ``cuda``, and where ``gefen`` was imported
  from, as JSON to ``$RELEASE_AUDIT_JSON``; :func:`evaluate_audit` turns that into a verdict.

It imports only the standard library and ``packaging`` (both in every environment the gate uses).
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import email.parser
import gzip
import io
import json
import os
import re
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    import pytest

# ----------------------------------------------------------------------------------------------------- CHANGELOG
CHANGE_TYPES = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
_RELEASE_HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\S+))?\s*$")


@dataclass
class ChangelogEntry:
    """One ``## [...]`` section of a changelog.

    Attributes:
        version: ``"Unreleased"`` or the version string between the brackets (e.g. ``"0.1.0"``).
        date: the ISO date after `` - `` (``"2026-12-01"``), ``None`` when absent.
        line: 1-based line number of the heading.
        sections: change type (``"Added"``, ...) -> its bullet items, in file order.
        stray_lines: 1-based numbers of non-blank lines that are neither a ``###`` heading nor part of a bullet.
    """

    version: str
    date: str | None
    line: int
    sections: dict[str, list[str]] = field(default_factory=dict)
    stray_lines: list[int] = field(default_factory=list)


def parse_changelog(text: str) -> list[ChangelogEntry]:
    """Split a Keep-a-Changelog text into its ``## [...]`` entries (no validation; see :func:`check_changelog`).

    Args:
        text: the whole CHANGELOG.md.

    Returns:
        The entries in file order. A ``###`` heading repeated inside one entry keeps its first list and records
        the repeat under the key ``"<name> (repeated)"``; a bullet continued on indented lines is one item.
    """
    entries: list[ChangelogEntry] = []
    current: ChangelogEntry | None = None
    items: list[str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if line.startswith("## "):
            match = _RELEASE_HEADING.match(line)
            version, date = (match["version"], match["date"]) if match else (line[3:].strip(), None)
            current, items = ChangelogEntry(version=version, date=date, line=number), None
            entries.append(current)
        elif current is None or not line.strip():
            continue
        elif line.startswith("### "):
            name = line[4:].strip()
            key = f"{name} (repeated)" if name in current.sections else name
            items = current.sections.setdefault(key, [])
        elif line.startswith("- ") and items is not None:
            items.append(line[2:].strip())
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
        elif re.match(r"^\[[^\]]+\]: \S+", line):
            continue  # a link reference definition ("[0.1.0]: https://...")
        else:
            current.stray_lines.append(number)
    return entries


def check_changelog(text: str) -> list[str]:
    """List every way ``text`` departs from the Keep a Changelog 1.1.0 layout this project uses.

    Checked: a ``# Changelog`` title; ``## [Unreleased]`` as the first entry (and only there); every other entry
    ``## [X.Y.Z] - YYYY-MM-DD`` with a PEP 440 version, a real calendar date, versions strictly decreasing and
    dates not increasing down the file, no version twice; ``###`` headings only from :data:`CHANGE_TYPES`, none
    repeated or empty within an entry; no text outside bullets; at least one released entry with changes.

    Args:
        text: the whole CHANGELOG.md.

    Returns:
        Human-readable problems, each naming the line; empty when the changelog is well formed.
    """
    problems: list[str] = []
    if not text.startswith("# Changelog\n"):
        problems.append("line 1: the file must start with the title '# Changelog'")
    entries = parse_changelog(text)
    if not entries or entries[0].version != "Unreleased":
        problems.append("the first '## ' entry must be '## [Unreleased]'")
    previous: tuple[Version, dt.date] | None = None
    seen: set[str] = set()
    for entry in entries:
        where = f"line {entry.line}"
        for name, items in entry.sections.items():
            if name not in CHANGE_TYPES:
                problems.append(f"{where}: '### {name}' is not one of {', '.join(CHANGE_TYPES)} (or is repeated)")
            elif not items:
                problems.append(f"{where}: '### {name}' of [{entry.version}] has no '- ' items")
        problems += [f"line {n}: text outside a '- ' bullet under a '### ' heading" for n in entry.stray_lines]
        if entry.version == "Unreleased":
            if entry is not entries[0] or entry.date is not None:
                problems.append(f"{where}: '## [Unreleased]' must be the first entry and carries no date")
            continue
        try:
            version = Version(entry.version)
            date = dt.date.fromisoformat(entry.date or "")
        except (InvalidVersion, ValueError):
            problems.append(f"{where}: expected '## [X.Y.Z] - YYYY-MM-DD', got {entry.version=}, {entry.date=}")
            continue
        if entry.version in seen:
            problems.append(f"{where}: version {entry.version} appears twice")
        seen.add(entry.version)
        if not entry.sections:
            problems.append(f"{where}: [{entry.version}] lists no changes")
        if previous is not None and not (version < previous[0] and date <= previous[1]):
            problems.append(f"{where}: [{entry.version}] - {date} must be older than the entry above it")
        previous = (version, date)
    if previous is None:
        problems.append("no released '## [X.Y.Z] - YYYY-MM-DD' entry")
    return problems


def top_released_version(text: str) -> str:
    """Return the version of the first released (dated) entry of a changelog, e.g. ``"0.1.0"``.

    Raises:
        ValueError: the changelog has no ``## [X.Y.Z] - YYYY-MM-DD`` entry.
    """
    for entry in parse_changelog(text):
        if entry.version != "Unreleased" and entry.date is not None:
            return entry.version
    raise ValueError("the changelog has no released '## [X.Y.Z] - YYYY-MM-DD' entry")


# ------------------------------------------------------------------------------------------------------ versions
def read_version_file(path: str | Path) -> str:
    """Return the string assigned to ``__version__`` in a Python file (``src/gefen/_version.py``), without
    importing it.

    Raises:
        ValueError: no top-level ``__version__ = "<string literal>"`` assignment.
        OSError: the file cannot be read.
    """
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise ValueError(f"{path}: no top-level __version__ = '<string>' assignment")


def dist_version(path: str | Path) -> str:
    """Return the ``Version`` recorded in a built distribution's metadata.

    Args:
        path: a wheel (``*.whl``: its ``*.dist-info/METADATA``) or an sdist (``*.tar.gz``: its top-level
            ``PKG-INFO``).

    Raises:
        ValueError: not a wheel or sdist, or its metadata file or ``Version`` field is missing.
    """
    path = Path(path)
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            raw = archive.read(names[0]) if len(names) == 1 else None
    elif path.name.endswith(".tar.gz"):
        with tarfile.open(path, "r:gz") as archive:
            members = [m for m in archive.getmembers() if re.fullmatch(r"[^/]+/PKG-INFO", m.name) and m.isfile()]
            handle = archive.extractfile(members[0]) if len(members) == 1 else None
            raw = handle.read() if handle is not None else None
    else:
        raise ValueError(f"{path}: expected a .whl or .tar.gz distribution")
    if raw is None:
        raise ValueError(f"{path}: no single metadata file (METADATA or PKG-INFO) found")
    version = email.parser.BytesParser().parsebytes(raw, headersonly=True)["Version"]
    if not version:
        raise ValueError(f"{path}: its metadata has no Version field")
    return str(version)


# ---------------------------------------------------------------------------------------------------- sdist
def normalize_sdist(path: str | Path, epoch: int) -> None:
    """Re-pack a ``.tar.gz`` sdist in place so that its bytes depend only on the files' names, types, contents
    and executable bits.

    Members are written sorted by name in PAX format with ``mtime=epoch``, uid/gid 0 and empty owner names;
    directories get mode 0o755, files 0o755 when any execute bit was set and 0o644 otherwise; the gzip header
    carries no file name and mtime 0 (level 9).

    Args:
        path: the sdist; rewritten in place (through a temporary file beside it).
        epoch: the mtime to stamp on every member, in seconds since 1970 (the gate uses ``SOURCE_DATE_EPOCH``).

    Raises:
        ValueError: ``epoch`` is negative, or the archive holds something other than files, folders and
            symlinks.
        tarfile.TarError: ``path`` is not a readable gzip tar archive.
    """
    if epoch < 0:
        raise ValueError(f"{epoch=}. Must be >= 0 (seconds since 1970)")
    path = Path(path)
    with tarfile.open(path, "r:gz") as source:
        members = sorted(source.getmembers(), key=lambda m: m.name)
        payload: list[tuple[tarfile.TarInfo, bytes | None]] = []
        for member in members:
            if not (member.isfile() or member.isdir() or member.issym()):
                raise ValueError(f"{path}: member {member.name!r} is neither a file, a folder nor a symlink")
            clean = tarfile.TarInfo(member.name)
            clean.type, clean.linkname = member.type, member.linkname
            clean.mtime, clean.uid, clean.gid, clean.uname, clean.gname = epoch, 0, 0, "", ""
            clean.mode = 0o755 if member.isdir() or member.mode & 0o111 else 0o644
            data = None
            if member.isfile():
                handle = source.extractfile(member)
                data = handle.read() if handle is not None else b""
                clean.size = len(data)
            payload.append((clean, data))
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.PAX_FORMAT) as target:
        for clean, data in payload:
            target.addfile(clean, io.BytesIO(data) if data is not None else None)
    temporary = path.with_name(path.name + ".normalizing")
    with open(temporary, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as packed:
        packed.write(tar_bytes.getvalue())
    os.replace(temporary, path)


# ---------------------------------------------------------------------------------------------- pytest plugin
_AUDIT: dict = {}  # filled by the collection hook, read by the summary hook


def pytest_collection_finish(session: pytest.Session) -> None:
    """pytest hook: record how many items were collected, which are marked ``cuda``, and how many come from the
    imported ``gefen`` folder (the installed package's doctests, when the gate runs ``--pyargs gefen``)."""
    gefen = sys.modules.get("gefen")
    package = Path(gefen.__file__).resolve().parent if gefen is not None and gefen.__file__ else None
    _AUDIT["collected"] = len(session.items)
    _AUDIT["cuda_nodeids"] = {item.nodeid for item in session.items if item.get_closest_marker("cuda") is not None}
    _AUDIT["gefen_items"] = sum(
        1 for item in session.items if package is not None and package in Path(str(item.path)).resolve().parents
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    """pytest hook: write the audit JSON (see the module docstring) to ``$RELEASE_AUDIT_JSON`` when it is set."""
    target = os.environ.get("RELEASE_AUDIT_JSON")
    if not target:
        return
    stats = terminalreporter.stats
    cuda_nodeids = _AUDIT.get("cuda_nodeids", set())
    skipped = []
    for report in stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        skipped.append({"nodeid": report.nodeid, "reason": reason, "cuda": report.nodeid in cuda_nodeids})
    gefen = sys.modules.get("gefen")
    audit = {
        "exitstatus": int(exitstatus),
        "collected": _AUDIT.get("collected", 0),
        "gefen_items": _AUDIT.get("gefen_items", 0),
        "gefen_file": getattr(gefen, "__file__", None),
        **{key: len(stats.get(key, [])) for key in ("passed", "failed", "error", "xfailed", "xpassed")},
        "skipped": skipped,
    }
    Path(target).write_text(json.dumps(audit, indent=1), encoding="utf-8")


@dataclass
class AuditVerdict:
    """What :func:`evaluate_audit` concluded.

    Attributes:
        ok: the run may pass the gate.
        summary: ``"N passed, F failed, K skipped (cuda)"`` (F counts failures and errors).
        problems: why it may not, one sentence each; empty when ``ok``.
    """

    ok: bool
    summary: str
    problems: list[str]


def evaluate_audit(audit: dict, *, forbidden_roots: Sequence[str | Path], require_package_items: bool) -> AuditVerdict:
    """Judge a test run recorded by the plugin of this module.

    The run passes when pytest exited 0, something was collected and passed, nothing failed, errored or
    unexpectedly passed (xpassed), every skipped test is marked ``cuda``, ``gefen`` was imported from outside
    every folder of ``forbidden_roots``, and (when ``require_package_items``) some collected items came from
    the imported ``gefen`` package itself (its doctests).

    Args:
        audit: the JSON object the plugin wrote.
        forbidden_roots: folders ``gefen`` must not be imported from (the source checkout and its clean copies).
        require_package_items: demand the installed package's doctests were collected.

    Returns:
        An :class:`AuditVerdict`.

    Raises:
        KeyError: ``audit`` lacks one of the plugin's keys.
    """
    failed = audit["failed"] + audit["error"]
    cuda_skips = [s for s in audit["skipped"] if s["cuda"]]
    other_skips = [s for s in audit["skipped"] if not s["cuda"]]
    summary = f"{audit['passed']} passed, {failed} failed, {len(cuda_skips)} skipped (cuda)"
    problems = []
    if audit["exitstatus"] != 0:
        problems.append(f"pytest exited with status {audit['exitstatus']}")
    if audit["collected"] == 0 or audit["passed"] == 0:
        problems.append("no test ran")
    if failed:
        problems.append(f"{audit['failed']} failed and {audit['error']} errors")
    if audit["xpassed"]:
        problems.append(f"{audit['xpassed']} tests marked xfail passed")
    if other_skips:
        listed = "; ".join(f"{s['nodeid']} ({s['reason']})" for s in other_skips[:5])
        problems.append(f"{len(other_skips)} tests not marked cuda were skipped: {listed}")
    gefen_file = audit["gefen_file"]
    if not gefen_file:
        problems.append("the tests never imported gefen")
    else:
        location = Path(gefen_file).resolve()
        for root in forbidden_roots:
            if Path(root).resolve() in location.parents:
                problems.append(f"gefen was imported from {location}, inside {root}, not from the installed wheel")
    if require_package_items and audit["gefen_items"] == 0:
        problems.append("no doctest of the installed gefen package was collected")
    return AuditVerdict(ok=not problems, summary=summary, problems=problems)


# -------------------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """Command line of this module (see ``--help``); returns 0 when the check passes, 1 when it fails."""
    parser = argparse.ArgumentParser(prog="release_tools.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version-file", help="print __version__ of a Python file").add_argument("path")
    sub.add_parser("dist-version", help="print the Version of a wheel or sdist").add_argument("path")
    sub.add_parser("changelog", help="check CHANGELOG.md, print its top released version").add_argument("path")
    sdist = sub.add_parser("normalize-sdist", help="re-pack an sdist reproducibly, in place")
    sdist.add_argument("path")
    sdist.add_argument("--epoch", type=int, required=True, help="mtime of every member (SOURCE_DATE_EPOCH)")
    audit = sub.add_parser("audit", help="judge the plugin's JSON; print the test summary")
    audit.add_argument("path")
    audit.add_argument("--forbid", action="append", default=[], help="gefen must not come from this folder")
    audit.add_argument("--require-package-items", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "version-file":
            print(read_version_file(args.path))
        elif args.command == "dist-version":
            print(dist_version(args.path))
        elif args.command == "changelog":
            text = Path(args.path).read_text(encoding="utf-8")
            problems = check_changelog(text)
            for problem in problems:
                print(f"{args.path}: {problem}", file=sys.stderr)
            if problems:
                return 1
            print(top_released_version(text))
        elif args.command == "normalize-sdist":
            normalize_sdist(args.path, args.epoch)
        else:
            verdict = evaluate_audit(
                json.loads(Path(args.path).read_text(encoding="utf-8")),
                forbidden_roots=args.forbid,
                require_package_items=args.require_package_items,
            )
            print(verdict.summary)
            for problem in verdict.problems:
                print(problem, file=sys.stderr)
            return 0 if verdict.ok else 1
    except (OSError, ValueError, KeyError, tarfile.TarError, zipfile.BadZipFile) as exc:
        print(f"release_tools {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
