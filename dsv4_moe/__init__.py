"""dsv4_moe — DeepSeek-V4 MoE FFN layers as standalone PyTorch modules.

    from dsv4_moe import load_moe_layer
    layer = load_moe_layer(checkpoint_dir, layer_idx=3, device="cuda")
    out = layer(hidden_states, input_ids)        # [T, H] bf16 -> [T, H] bf16
    print(layer.explain(num_tokens=16))
"""

from . import reference  # noqa: F401
from .config import MoEConfig
from .dispatch import force_paths
from .graphs import GraphedMoE
from .layers import DeepseekV4MLP, DeepseekV4MoE, load_moe_layer

__all__ = ["MoEConfig", "DeepseekV4MLP", "DeepseekV4MoE", "GraphedMoE", "load_moe_layer", "force_paths",
           "reference"]
__version__ = "0.1.0"
