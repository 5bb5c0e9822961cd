"""README.md's CPU example runs as written (the first ```python block of "Using it"), and every
dispatch stage name the README lists is one dispatch knows."""
import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _text():
    with open(README) as f:
        return f.read()


def test_cpu_example_runs(tmp_path):
    section = _text().split("## Using it", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'device="cpu"' in code, "the first example is the CPU one"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)   # not the repository root: the installed package
    assert r.returncode == 0 and "torch.Size([4, 256])" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_stage_names_are_dispatchs():
    from dsv4_moe import dispatch

    para = _text().split("the names `force_paths` and `explain()` use for the dispatch stages", 1)[1].split("\n\n")[0]
    names = re.findall(r"`([a-z0-9_]+)`", para)
    assert names == list(dispatch.STAGES), names
