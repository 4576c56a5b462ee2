"""A text-classification data set made from the running Python's standard library: docstrings labelled by the
top-level package they come from.

How it is built (:func:`build_dataset`):

1. For each package of :data:`PACKAGES`, every ``.py`` file under ``<stdlib>/<package>/`` (folders named
   ``test``/``tests``/``idle_test`` skipped) is parsed with :mod:`ast` (nothing is imported), and the docstrings of
   the module and of every class and function are collected (``ast.get_docstring``, cleaned).
2. Each docstring is normalised (whitespace runs become one space) and kept when it has at least
   :data:`MIN_WORDS` words. A text found in more than one package is dropped (its label is ambiguous); a text
   found twice in one package is kept once.
3. Every package is cut to the size of the smallest one (a seeded sample), so the classes are balanced and
   chance accuracy is ``1/len(PACKAGES)``.
4. Each class is shuffled with the seed and its first ``eval_fraction`` (rounded) goes to the eval split, the rest
   to the train split (stratified); both splits are then shuffled with the seed.

The result depends only on the seed and on the standard library's sources (so on the Python version: about
185 docstrings per class and 1,110 in all on CPython 3.11).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PACKAGES", "MIN_WORDS", "Example", "Dataset", "stdlib_root", "package_docstrings", "build_dataset"]

#: The labels, in label-id order: packages present in every CPython from 3.10 on, each with 180+ docstrings.
PACKAGES = ("asyncio", "email", "importlib", "logging", "multiprocessing", "xml")

#: Docstrings shorter than this many words (e.g. "Return the name.") carry too little to classify.
MIN_WORDS = 5

_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__"})
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclasses.dataclass(frozen=True)
class Example:
    """One labelled docstring.

    Attributes:
        text: the normalised docstring (one line, single spaces).
        label: index into :data:`PACKAGES`.
    """

    text: str
    label: int


@dataclasses.dataclass(frozen=True)
class Dataset:
    """The two splits and their label names.

    Attributes:
        labels: the package names, ``labels[example.label]``.
        train: training examples (seeded order).
        eval: held-out examples (seeded order), disjoint from ``train`` in text.
    """

    labels: tuple[str, ...]
    train: tuple[Example, ...]
    eval: tuple[Example, ...]

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the data set to ``path`` as JSON (``{"labels", "train", "eval"}``, examples as
        ``[text, label]``)."""
        payload = {
            "labels": list(self.labels),
            "train": [[e.text, e.label] for e in self.train],
            "eval": [[e.text, e.label] for e in self.eval],
        }
        Path(path).write_text(json.dumps(payload), encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Dataset:
        """Read a data set written by :meth:`to_json`.

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not such a JSON document.
        """
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
        try:
            return cls(
                labels=tuple(payload["labels"]),
                train=tuple(Example(str(t), int(lab)) for t, lab in payload["train"]),
                eval=tuple(Example(str(t), int(lab)) for t, lab in payload["eval"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path} is not a data set written by Dataset.to_json: {err}") from err


def stdlib_root() -> Path:
    """The folder of the running Python's standard library (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(folder: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath, name)


def package_docstrings(package: str, root: Path | None = None) -> list[str]:
    """Normalised docstrings of one standard-library package, in file and source order, duplicates removed.

    Args:
        package: a package folder under the standard library, e.g. ``"email"``.
        root: the standard library's folder (default :func:`stdlib_root`).

    Returns:
        Texts of at least :data:`MIN_WORDS` words.

    Raises:
        FileNotFoundError: ``root/package`` is not a folder.
    """
    folder = (root or stdlib_root()) / package
    if not folder.is_dir():
        raise FileNotFoundError(f"no standard-library package folder {folder}")
    texts: dict[str, None] = {}
    for path in _python_files(folder):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # e.g. a lib2to3-style fixture written for another Python
        for node in ast.walk(tree):
            if isinstance(node, _DOCUMENTED):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    text = " ".join(doc.split())
                    if len(text.split()) >= MIN_WORDS:
                        texts.setdefault(text)
    return list(texts)


def build_dataset(
    seed: int = 0, eval_fraction: float = 0.25, packages: tuple[str, ...] = PACKAGES, root: Path | None = None
) -> Dataset:
    """Build the balanced, deduplicated docstring classification data set (see the module docstring).

    Args:
        seed: seeds the per-class sample, the split and the shuffles.
        eval_fraction: share of each class held out, in ``(0, 1)``.
        packages: the label set, in label-id order (at least two).
        root: the standard library's folder (default :func:`stdlib_root`).

    Returns:
        A :class:`Dataset` with ``labels == packages``.

    Raises:
        ValueError: ``eval_fraction`` outside ``(0, 1)``, fewer than two packages, or a split left empty.
        FileNotFoundError: a package is missing from the standard library.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")
    if len(packages) < 2:
        raise ValueError(f"a classification data set needs at least two packages, got {packages!r}")
    per_package = {p: package_docstrings(p, root) for p in packages}
    owners: dict[str, set[str]] = {}
    for package, texts in per_package.items():
        for text in texts:
            owners.setdefault(text, set()).add(package)
    unique = {p: [t for t in texts if len(owners[t]) == 1] for p, texts in per_package.items()}
    size = min(len(texts) for texts in unique.values())
    n_eval = round(size * eval_fraction)
    if n_eval == 0 or n_eval == size:
        raise ValueError(f"{size} docstrings per class cannot be split with eval_fraction={eval_fraction}")
    rng = random.Random(seed)
    train: list[Example] = []
    held_out: list[Example] = []
    for label, package in enumerate(packages):
        chosen = rng.sample(unique[package], size)  # a seeded sample, already in random order
        held_out += [Example(t, label) for t in chosen[:n_eval]]
        train += [Example(t, label) for t in chosen[n_eval:]]
    rng.shuffle(train)
    rng.shuffle(held_out)
    return Dataset(labels=tuple(packages), train=tuple(train), eval=tuple(held_out))
