"""Command-line pieces shared by the ``gefen`` commands: the demo model and data flags (``gefen demo`` and
``gefen find-lr`` train the same byte-level transformer on the same corpus and batches), and the checks of output
paths and of the optional ``demo`` extra (matplotlib, tqdm) that every command runs before any work.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

__all__ = ["PIP_HINT", "PLOT_SUFFIXES", "add_model_and_data_arguments", "default_threads", "output_problem"]

#: File types the commands' ``--plot`` writes (matplotlib picks the format from the suffix).
PLOT_SUFFIXES = (".png", ".pdf", ".svg")

#: How to install the optional packages of plots and progress bars (named in help texts and errors).
PIP_HINT = "pip install 'gefen[demo]'"


def default_threads() -> int:
    """The CPU cores this process may run on (its affinity mask on Linux, else ``os.cpu_count()``): the default
    torch thread count of the commands' training processes."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def add_model_and_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--batch-size``, ``--seq-len``, ``--model-size``, ``--seed`` and ``--data`` to ``parser``.

    Args:
        parser: a command's parser. The parsed values: ``batch_size`` (int, sequences per batch, default 16),
            ``seq_len`` (int, bytes per sequence and the model context, default 128), ``model_size`` (a key of
            ``MODEL_SIZES``, default ``"small"``), ``seed`` (int, initial weights and batches, default 0) and
            ``data`` (a path or ``None`` for the standard library's ``.py`` files). Range checks are the
            command's.
    """
    from gefen.cli._model_config import MODEL_SIZES

    add = parser.add_argument
    add("--batch-size", type=int, default=16, help="sequences per batch (default: %(default)s)")
    add("--seq-len", type=int, default=128, help="bytes per sequence, also the model context (default: %(default)s)")
    add(
        "--model-size",
        choices=sorted(MODEL_SIZES),
        default="small",
        help="tiny ≈ 0.9M params, small ≈ 3.3M params (default: %(default)s)",
    )
    add("--seed", type=int, default=0, help="seed of the initial weights and of the batches (default: %(default)s)")
    add(
        "--data",
        default=None,
        metavar="PATH",
        help="text file or directory of text files (default: the Python stdlib .py files)",
    )


def output_problem(command: str, outputs: dict[str, str | None], plot: str | None, progress: bool) -> str | None:
    """The first reason a command cannot write its outputs or show its progress, or ``None``.

    Args:
        command: the command's name for messages (``"gefen demo"``).
        outputs: flag -> path (``None``: not asked) of every file the command will write (``--plot`` included);
            each path's folder must exist.
        plot: the ``--plot`` path or ``None``; a plot needs matplotlib.
        progress: whether the command shows a tqdm progress bar (tqdm must be installed).

    Returns:
        One sentence naming the flag or package and the fix, or ``None`` when everything is usable: a path that
        is a folder, a missing folder, a plot whose suffix is not one of :data:`PLOT_SUFFIXES`, a missing package.
    """
    for flag, path in outputs.items():
        if path is None:
            continue
        if Path(path).is_dir():
            return f"{flag} {path!r} is a folder; give a file name."
        folder = Path(path).resolve().parent
        if not folder.is_dir():
            return f"{flag} {path!r}: folder {str(folder)!r} does not exist; create it first."
    if plot is not None and Path(plot).suffix.lower() not in PLOT_SUFFIXES:
        return f"--plot {plot!r}: give a {', '.join(PLOT_SUFFIXES[:-1])} or {PLOT_SUFFIXES[-1]} file name."
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        return f"--plot needs matplotlib, which is not installed; run: {PIP_HINT}"
    if progress and importlib.util.find_spec("tqdm") is None:
        return f"{command} shows progress with tqdm, which is not installed; run: {PIP_HINT}"
    return None
