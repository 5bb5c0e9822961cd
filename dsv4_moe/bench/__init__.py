"""dsv4_moe.bench — the layer-level benchmark (`python -m dsv4_moe bench`).

    model.py      unique bytes / FLOPs of a forward and its floor (one place, shared with tests)
    timing.py     CUDA events, CUDA graphs, rotated input sets, median; measured ceilings
    synthetic.py  full-size synthetic layer weights generated on the device
    ours.py       this package's layer paths and per-stage callables (via dsv4_moe.dispatch)
    peers.py      baselines: torch router, torch._grouped_mm, torch blockwise scaled_mm, deep_gemm
    _humming.py   baselines: humming-kernels MXFP4 MoE (W4A16, W4A8); the wheel download line
    sweep.py      the token sweep: input sets, check-then-time rows
    report.py     aligned table, JSON, plot
    run.py        argparse `main(argv)`
"""
from .run import main

__all__ = ["main"]
