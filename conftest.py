"""Suite-wide settings (this file sits at the root so it also covers the doctests under ``src/``).

``fused=None`` means "compiled where it works"; compiling a kernel per parameter signature costs seconds, which
would dominate a test suite of many small optimizers. So the suite runs the eager twin by default
(``GEFEN_FUSED=0``) and the compiled path is tested explicitly with ``fused=True`` in
``tests/optim/test_gefen_fused.py``. An explicit ``GEFEN_FUSED`` in the environment wins.
"""

import os

os.environ.setdefault("GEFEN_FUSED", "0")
