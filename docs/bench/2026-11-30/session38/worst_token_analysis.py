# Pro-TP8 T = 4096, token 692 (gpu_check_layer_stages.py's saved pieces, 583dcfd): why one route's y
# differs on 98 % of its outputs. Every element of h that the clamp saturates (g >= L, |u| >= L) is
# +-silu(L) * L * w; run from the repository root:
#   python3 docs/bench/2026-11-30/session38/worst_token_analysis.py
import os
import torch
import torch.nn.functional as F

d = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "worst_token_pro-tp8_T4096.pt"))
gw, rw = d["gpu_weights"], d["ref_weights"]
sat = F.silu(torch.tensor(10.0)) * 10.0
print(f"token {d['token']}, ids {d['gpu_ids'].tolist()} (reference {d['ref_ids'].tolist()})")
for j in range(len(gw)):
    a, b = sat * gw[j], sat * rw[j]
    qa, qb = a.bfloat16().float(), b.bfloat16().float()
    scale = 0.125   # the route's h group scales, both weights (the stages log)
    ca = (qa / scale).to(torch.float8_e4m3fn).float() * scale
    cb = (qb / scale).to(torch.float8_e4m3fn).float() * scale
    print(f"slot {j}: w GPU {gw[j].item():.9f} ref {rw[j].item():.9f} (rel {((gw[j] - rw[j]).abs() / rw[j]).item():.1e}); "
          f"saturated h fp32 GPU {a.item():.8f} ref {b.item():.8f} -> bf16 {qa.item()} / {qb.item()} -> e4m3 x scale "
          f"{ca.item()} / {cb.item()}{'   <- differs' if ca != cb else ''}")
y = (d["gpu_y"].float() - d["ref_y"].float()).abs().amax(1)
print("per slot max |y GPU - y ref|:", [round(v, 4) for v in y.tolist()])
print("layer row max |d| against the whole reference:", (d["gpu_out"].float() - d["ref_out"].float()).abs().max().item(),
      "; against the reference on the GPU's route weights and shared output:",
      (d["gpu_out"].float() - d["ref_out_bounded"].float()).abs().max().item())
