"""Suite-wide settings (this file sits at the root so it also covers the doctests under ``src/``).

``fused=None`` means "compiled where it works"; compiling a kernel per parameter signature costs seconds, which
would dominate a test suite of many small optimizers. So the suite runs the eager twin by default
(``GEFEN_FUSED=0``) and the compiled path is tested explicitly with ``fused=True`` in
``tests/optim/test_gefen_fused.py``. An explicit ``GEFEN_FUSED`` in the environment wins.
"""

import os

os.environ.setdefault("GEFEN_FUSED", "0")

# Triton's interpreter runs the Triton backend's kernels on CPU tensors (tests/triton_interpreter.py); it is chosen
# when triton is first imported, so it is set here, before any test module imports it. On a machine with a GPU (the
# CUDA checks of scripts/gpu_check.sh) the kernels compile for the device instead.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
