"""A plain (non-editable) install must ship dsv4_moe.kernels and dsv4_moe.weights
(mapped from kernels/ and weights/) and the embedded default checkpoint."""

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_contains_mapped_packages_and_imports(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = list((tmp_path / "dist").glob("dsv4_moe-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    for must in ("dsv4_moe/kernels/__init__.py", "dsv4_moe/weights/__init__.py", "dsv4_moe/weights/formats.py",
                 "dsv4_moe/reference/__init__.py", "dsv4_moe/weights/default/config.json",
                 "dsv4_moe/weights/default/model.safetensors.index.json"):
        assert must in names, f"{must} missing from {whl.name}"
    assert any(n.startswith("dsv4_moe/weights/default/model-") for n in names)
    target = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(target)
    code = ("import dsv4_moe, dsv4_moe.kernels, dsv4_moe.weights; "
            "from dsv4_moe.weights.default import DEFAULT_CHECKPOINT_DIR as d; "
            "assert d.startswith(%r), d; import os; assert os.path.exists(os.path.join(d, 'config.json')); "
            "print(dsv4_moe.__file__)") % str(target)
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(target)}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith(str(target))
