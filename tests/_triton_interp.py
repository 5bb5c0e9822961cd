"""Test-only setup for running Triton kernels on CPU (TRITON_INTERPRET=1).

Import this module before triton in a test module. It sets TRITON_INTERPRET=1 (unless a
GPU is present, in which case kernels run natively) and works around a Triton 3.6
interpreter bug with numpy >= 2.4: scalars are size-1 1-D arrays there, and the
interpreter's `tensor.__index__` calls `int(array)`, which numpy now rejects; so
`for i in range(runtime_scalar)` fails inside kernels. The patch makes `__index__` use
`.item()`; nothing outside the interpreter is touched.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.runtime.interpreter as _interp  # noqa: E402

_orig_patch_lang_tensor = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _orig_patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if not getattr(_interp, "_dsv4_index_patched", False):  # idempotent across test modules
    _interp._patch_lang_tensor = _patch_lang_tensor
    _interp._dsv4_index_patched = True

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
