"""dsv4_moe.kernels — GPU kernels (Triton). Import-guarded: importing this package never
requires triton; each op module imports triton lazily."""
