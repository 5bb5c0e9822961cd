"""Session-wide test setup: on a machine without a GPU every Triton kernel runs in Triton's
interpreter (tests/_triton_interp.py sets TRITON_INTERPRET=1 and patches a numpy >= 2.4
incompatibility). Importing it here, before any test module imports the kernels, makes
the result independent of which test files are selected and in what order (a module that
set the variable at its own import used to leave earlier-imported modules compiled for
the GPU path)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _triton_interp  # noqa: E402, F401
