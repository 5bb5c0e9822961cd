"""Benchmark fused vs unfused SwiGLU-quant on one GPU (CUDA graphs, rotated inputs).

    OUT=./out python scripts/bench_swiglu_quant.py [--I 384,2048,3072] [--M 1,4,...]

One row per (I, M): us for fused (auto strategy), group, persistent and unfused; GB/s
(read 2I*2 + write I + scales bytes per row) and % of the device copy rate measured in
the same run. Use the group/persistent columns to set
kernels/swiglu_quant.PERSISTENT_MIN_ELEMENTS (smallest M*I where persistent wins).
Shares its timing code with scripts/gpu_check_shared.py.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check_shared as g  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--I", default="384,2048,3072")
    p.add_argument("--M", default="1,4,16,64,256,1024,4096,8192")
    p.add_argument("--budget", type=float, default=200.0)
    a = p.parse_args()
    g.I_LIST[:] = [int(v) for v in a.I.split(",")]
    g.M_LIST[:] = [int(v) for v in a.M.split(",")]
    sys.argv = [sys.argv[0], "--parts", "hw,t_swiglu", "--budget", str(a.budget)]
    g.main()


if __name__ == "__main__":
    main()
