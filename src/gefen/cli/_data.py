"""The byte corpus of ``gefen demo``: which files, the train/eval split, and the batches.

This module owns reading text into bytes, the held-out rule, the seeded random training batches and the
fixed evaluation windows. It knows nothing about models or optimizers.

Default corpus: every ``.py`` file of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), excluding anything under ``site-packages`` or ``dist-packages``.
``--data PATH`` replaces it with one text file or a directory of files (searched recursively; hidden
files and folders are skipped, and so are files whose first 8 KiB contain a NUL byte, i.e. binaries; the
number skipped is reported).

Held-out rule: the file list is sorted by path; file ``i`` (0-based) goes to eval when ``i % 10 == 9``
(every 10th file), the rest to train. With fewer than 10 files that rule selects nothing, so the last 10%
of the concatenated bytes is held out instead; :attr:`Corpus.held_out_rule` says which rule applied.
Files are concatenated in sorted order with no separator.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["BatchSampler", "Corpus", "check_fits", "eval_windows", "load_corpus"]

_HELD_OUT_EVERY = 10
_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class Corpus:
    """Train and eval bytes plus where they came from.

    Attributes:
        train: (train_bytes,) uint8, the concatenated training files.
        eval: (eval_bytes,) uint8, the concatenated held-out files (or held-out tail).
        source: human-readable origin, e.g. ``"python-stdlib:/usr/lib/python3.11"`` or the ``--data`` path.
        n_files: files read (train + eval).
        n_eval_files: files held out for eval (0 when the byte-tail rule applied).
        n_skipped_files: files skipped as binary (NUL byte in the first 8 KiB) or unreadable as bytes.
        held_out_rule: the split rule that applied, in words.
    """

    train: Tensor
    eval: Tensor
    source: str
    n_files: int
    n_eval_files: int
    n_skipped_files: int
    held_out_rule: str

    def describe(self) -> dict[str, object]:
        """Return the JSON-ready summary: source, file counts, byte counts (int) and the held-out rule."""
        return {
            "source": self.source,
            "n_files": self.n_files,
            "n_train_files": self.n_files - self.n_eval_files,
            "n_eval_files": self.n_eval_files,
            "n_skipped_files": self.n_skipped_files,
            "train_bytes": int(self.train.numel()),
            "eval_bytes": int(self.eval.numel()),
            "held_out_rule": self.held_out_rule,
        }


def _stdlib_files() -> tuple[str, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if "site-packages" not in path.parts and "dist-packages" not in path.parts and path.is_file()
    ]
    return f"python-stdlib:{root}", sorted(files)


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _user_files(path: Path) -> tuple[str, list[Path]]:
    if not path.exists():
        raise FileNotFoundError(f"--data {str(path)!r} does not exist; pass a text file or a directory of text files.")
    if path.is_file():
        return str(path), [path]
    if not path.is_dir():
        raise ValueError(f"--data {str(path)!r} is neither a regular file nor a directory.")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not _is_hidden(p, path))
    return str(path), files


def _is_binary(blob: bytes) -> bool:
    return b"\x00" in blob[:_BINARY_SNIFF_BYTES]


def load_corpus(data_path: str | os.PathLike[str] | None = None) -> Corpus:
    """Read the corpus and split it into train and eval bytes by the module's held-out rule.

    Args:
        data_path: a text file or a directory of text files; ``None`` for the standard-library ``.py`` files.

    Returns:
        the :class:`Corpus` (uint8 tensors on CPU).

    Raises:
        FileNotFoundError: ``data_path`` does not exist.
        ValueError: ``data_path`` is not a file or directory, or no non-empty text file was found.
    """
    if data_path is None:
        source, files = _stdlib_files()
    else:
        source, files = _user_files(Path(data_path))
    blobs: list[bytes] = []
    skipped = 0
    for file in files:
        try:
            blob = file.read_bytes()
        except OSError:
            skipped += 1
            continue
        if _is_binary(blob):
            skipped += 1
            continue
        blobs.append(blob)
    total = sum(len(blob) for blob in blobs)
    if total == 0:
        raise ValueError(
            f"--data {source!r}: found {len(blobs)} text file(s) with 0 bytes in total "
            f"({skipped} skipped as binary or unreadable); point --data at non-empty text."
        )
    eval_indices = {i for i in range(len(blobs)) if i % _HELD_OUT_EVERY == _HELD_OUT_EVERY - 1}
    if eval_indices:
        train_bytes = b"".join(blob for i, blob in enumerate(blobs) if i not in eval_indices)
        eval_bytes = b"".join(blobs[i] for i in sorted(eval_indices))
        rule = "files i % 10 == 9 of the path-sorted file list (every 10th file)"
    else:
        joined = b"".join(blobs)
        cut = total - max(1, total // _HELD_OUT_EVERY)
        train_bytes, eval_bytes = joined[:cut], joined[cut:]
        rule = "fewer than 10 files: last 10% of the concatenated bytes"
    return Corpus(
        train=_to_tensor(train_bytes),
        eval=_to_tensor(eval_bytes),
        source=source,
        n_files=len(blobs),
        n_eval_files=len(eval_indices),
        n_skipped_files=skipped,
        held_out_rule=rule,
    )


def _to_tensor(blob: bytes) -> Tensor:
    if not blob:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def check_fits(corpus: Corpus, seq_len: int) -> None:
    """Check both splits hold at least one window of ``seq_len + 1`` bytes.

    Args:
        corpus: the loaded corpus.
        seq_len: model input length in bytes; a window is ``seq_len + 1`` bytes (inputs plus shifted targets).

    Raises:
        ValueError: a split is shorter than one window; the message gives both sizes and the fix.
    """
    window = seq_len + 1
    for split, data in (("train", corpus.train), ("eval", corpus.eval)):
        if data.numel() < window:
            raise ValueError(
                f"--data {corpus.source!r}: the {split} split has {data.numel()} bytes, fewer than one "
                f"window of seq_len + 1 = {window} bytes ({corpus.held_out_rule}); "
                f"add more text or lower --seq-len."
            )


class BatchSampler:
    """Random training windows drawn from a seeded generator, so every optimizer sees the same batches.

    Args:
        data: (n,) uint8 bytes with ``n >= seq_len + 1``.
        batch_size: windows per batch.
        seq_len: input length; each window holds ``seq_len + 1`` bytes.
        seed: seed of the private ``torch.Generator``; the k-th call to :meth:`next` depends only on
            ``(data, batch_size, seq_len, seed, k)``.
    """

    def __init__(self, data: Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        self._data = data
        self._batch_size = batch_size
        self._offsets = torch.arange(seq_len + 1)
        self._n_starts = data.numel() - seq_len  # starts in [0, n - seq_len - 1] inclusive
        self._generator = torch.Generator().manual_seed(seed)

    def next(self) -> Tensor:
        """Return the next batch: (batch_size, seq_len + 1) uint8, windows starting uniformly at random."""
        starts = torch.randint(0, self._n_starts, (self._batch_size,), generator=self._generator)
        return self._data[starts[:, None] + self._offsets]


def eval_windows(data: Tensor, seq_len: int, n_windows: int) -> Tensor:
    """The fixed evaluation set: ``n_windows`` windows at evenly spaced starts over ``data``.

    No randomness, so the eval set is the same for every optimizer, seed and run on the same data.

    Args:
        data: (n,) uint8 with ``n >= seq_len + 1``.
        seq_len: input length in bytes.
        n_windows: number of windows (they overlap when the data is short).

    Returns:
        (n_windows, seq_len + 1) uint8.
    """
    last_start = data.numel() - seq_len - 1
    starts = torch.linspace(0, last_start, n_windows).round().long()
    return data[starts[:, None] + torch.arange(seq_len + 1)]
