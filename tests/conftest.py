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

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dispatch_memo():
    """dispatch.select memoises its choices (and the kernel wrappers their launch options);
    tests replace predicates and hardware facts with monkeypatch, so each test starts and
    ends with empty memos."""
    from dsv4_moe import dispatch

    dispatch.clear_plan_cache()
    yield
    dispatch.clear_plan_cache()
