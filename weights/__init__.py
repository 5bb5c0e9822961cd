"""dsv4_moe.weights — the official checkpoint format: names, reader, slicing, writer."""
from .tensors import MoELayerWeights, RoutedExpertWeights, RouterWeights, SharedExpertWeights  # noqa: F401
from .names import TensorSpec, layer_tensor_names, parse_name  # noqa: F401
from .reader import CheckpointError, CheckpointReader, TensorRequest  # noqa: F401
from .quantize import quantize_fp8_block, quantize_mxfp4  # noqa: F401
from .writer import write_checkpoint  # noqa: F401
from .loader import check_device, load_layer_weights  # noqa: F401
from .cli import make_checkpoint_main  # noqa: F401

__all__ = [
    "MoELayerWeights", "RoutedExpertWeights", "RouterWeights", "SharedExpertWeights",
    "TensorSpec", "layer_tensor_names", "parse_name",
    "CheckpointError", "CheckpointReader", "TensorRequest",
    "quantize_fp8_block", "quantize_mxfp4",
    "write_checkpoint", "load_layer_weights", "check_device", "make_checkpoint_main",
]
