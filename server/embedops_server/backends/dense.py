"""sentence-transformers Dense projections after pooling (e.g. LaBSE's tanh layer, embeddinggemma's two
linear layers). Without them such models' vectors are silently wrong, so they are part of the model here.

Each module folder holds config.json (in_features, out_features, bias, activation_function) and the weights
(`linear.weight`, `linear.bias`) in model.safetensors or pytorch_model.bin.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.model_info import NO_TORCH, ModelError, torch_installed

# sentence-transformers' default activation is Tanh.
_DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"
_NUMPY = {
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Tanh": np.tanh,
    "torch.nn.modules.activation.ReLU": lambda x: np.maximum(x, 0),
    "torch.nn.modules.activation.Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}


@dataclass(frozen=True)
class DenseLayer:
    weight: np.ndarray  # (out, in), float32
    bias: np.ndarray | None
    activation: str

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


def _weights(folder: Path) -> dict[str, np.ndarray]:
    if (folder / "model.safetensors").exists():
        from safetensors.numpy import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").exists():
        if not torch_installed():
            raise ModelError(f"{folder}: Dense weights in pytorch_model.bin need torch and {NO_TORCH}; "
                             "ship model.safetensors")
        import torch

        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise ModelError(f"{folder}: Dense module without model.safetensors or pytorch_model.bin")


def load_dense(folders: tuple[Path, ...] | list[Path]) -> list[DenseLayer]:
    layers: list[DenseLayer] = []
    for folder in folders:
        try:
            cfg = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{folder}: unreadable Dense config: {e}") from e
        act = cfg.get("activation_function") or _DEFAULT_ACTIVATION
        if act not in _NUMPY:
            raise ModelError(f"{folder}: unsupported Dense activation {act!r}; supported: {sorted(_NUMPY)}")
        w = _weights(folder)
        weight = np.ascontiguousarray(w["linear.weight"], dtype=np.float32)
        bias = np.ascontiguousarray(w["linear.bias"], dtype=np.float32) if cfg.get("bias", True) else None
        # each layer's input is the previous layer's output
        want = (cfg.get("out_features"), layers[-1].out_features if layers else cfg.get("in_features"))
        if tuple(weight.shape) != want:
            raise ModelError(f"{folder}: Dense weight {tuple(weight.shape)} does not fit (out, in) = {want}")
        layers.append(DenseLayer(weight, bias, act))
    return layers


def apply_numpy(x: np.ndarray, layers: list[DenseLayer]) -> np.ndarray:
    for layer in layers:
        x = x @ layer.weight.T
        if layer.bias is not None:
            x = x + layer.bias
        x = _NUMPY[layer.activation](x)
    return x


class TorchDense:
    """The same layers as torch ops on the model's device, in float32 (captured into CUDA graphs with it)."""

    def __init__(self, layers: list[DenseLayer], device: str):
        import torch

        acts = {"torch.nn.modules.linear.Identity": lambda x: x, "torch.nn.modules.activation.Tanh": torch.tanh,
                "torch.nn.modules.activation.ReLU": torch.relu, "torch.nn.modules.activation.Sigmoid": torch.sigmoid}
        self.linear = torch.nn.functional.linear
        self.layers = [(torch.from_numpy(l.weight).to(device), None if l.bias is None else
                        torch.from_numpy(l.bias).to(device), acts[l.activation]) for l in layers]

    def __call__(self, x):
        for w, b, act in self.layers:
            x = act(self.linear(x, w, b))
        return x
