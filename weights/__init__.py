"""dsv4_moe.weights — the official checkpoint format: names, reader, slicing, writer."""
from .tensors import MoELayerWeights, RoutedExpertWeights, RouterWeights, SharedExpertWeights  # noqa: F401
