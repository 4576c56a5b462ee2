"""How the torchrun examples end a finished run (imported by ``ddp_train.py`` and ``fsdp2_train.py``)."""

from __future__ import annotations

import os
import sys


def leave() -> None:
    """End a run that finished, without the interpreter's own shutdown; exit status 0.

    A gloo worker thread can still be releasing the tensors of the last collectives when Python shuts down; when
    it then asks for the GIL, the whole process aborts ("terminate called without an active exception",
    pytorch/pytorch#190489) after it trained and saved correctly. Call it once everything is written and the
    process group is destroyed: it flushes stdout and stderr and ends the process with ``os._exit(0)``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
