"""dsv4_moe — DeepSeek-V4 MoE FFN layers as standalone PyTorch modules."""
from .config import MoEConfig  # noqa: F401

__version__ = "0.1.0"
