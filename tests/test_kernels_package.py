"""dsv4_moe.kernels' lazy names: importing the package imports no triton, each exported name is
the same object on every access, and an op module whose function has its name stays the module
(session 38: `K.act_quant` was the function on first access and the module after it)."""
import subprocess
import sys

CODE = r"""
import inspect, sys
import dsv4_moe.kernels as K
assert "triton" not in sys.modules, "importing dsv4_moe.kernels imported triton"
for name in K._SAME_NAME:
    first, second = getattr(K, name), getattr(K, name)
    assert inspect.ismodule(first) and first is second, (name, first, second)
    assert callable(getattr(first, name)), name
for name in K.__all__:
    first, second = getattr(K, name), getattr(K, name)
    assert first is second and not inspect.ismodule(first), (name, first, second)
    assert name not in K._SAME_NAME, name
from dsv4_moe.kernels.act_quant import act_quant
from dsv4_moe.kernels import moe_align
assert inspect.isfunction(act_quant) and inspect.ismodule(moe_align)
try:
    K.no_such_op
except AttributeError as e:
    assert "no_such_op" in str(e)
else:
    raise AssertionError("unknown name did not raise")
print("ok")
"""


def test_lazy_names_are_stable_and_modules_stay_modules(tmp_path):
    # a fresh interpreter (nothing imported yet), outside the repository root (the installed package)
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
