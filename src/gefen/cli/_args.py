"""Command-line arguments shared by ``gefen demo`` and ``gefen find-lr``: the demo model and its batches.

Both commands train the same byte-level transformer (``_model.py``) on the same corpus and batches
(``_data.py``), so the flags that choose them are defined once here.
"""

from __future__ import annotations

import argparse

__all__ = ["add_model_and_data_arguments"]


def add_model_and_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--batch-size``, ``--seq-len``, ``--model-size``, ``--seed`` and ``--data`` to ``parser``.

    Args:
        parser: a command's parser. The parsed values: ``batch_size`` (int, sequences per batch, default 16),
            ``seq_len`` (int, bytes per sequence and the model context, default 128), ``model_size`` (a key of
            ``MODEL_SIZES``, default ``"small"``), ``seed`` (int, initial weights and batches, default 0) and
            ``data`` (a path or ``None`` for the standard library's ``.py`` files). Range checks are the
            command's.
    """
    from gefen.cli._model import MODEL_SIZES

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
