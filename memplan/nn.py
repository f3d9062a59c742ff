"""Building blocks for model files: weight initialisation and stochastic depth.

``init_weights(model, scheme)`` re-initialises a model in place with one of the usual schemes,
and ``DropPath(p)`` drops whole residual branches per sample (stochastic depth, as in timm's
``DropPath``). Both are plain PyTorch: a model file uses them in ``model()`` and memplan traces
them like any other layer (DropPath's mask is a ``(batch, 1, ..., 1)`` tensor and its output one
activation, both in the estimate).

Example:
    >>> import torch, torch.nn as nn
    >>> from memplan.nn import DropPath, init_weights
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = init_weights(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), "trunc_normal", std=0.02)
    >>> bool(net[0].weight.abs().max() <= 0.04), float(net[0].bias.abs().max())
    (True, 0.0)
    >>> DropPath(0.1).eval()(torch.ones(2, 3)).sum().item()  # identity in eval
    6.0
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn as nn

from estimators import ConfigError

__all__ = ["InitScheme", "init_weights", "DropPath", "drop_path"]

InitScheme = Literal["xavier", "kaiming", "trunc_normal"]

Nonlinearity = Literal["linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                       "conv_transpose3d", "sigmoid", "tanh", "relu", "leaky_relu", "selu"]
"""The nonlinearities whose gain ``torch.nn.init.calculate_gain`` knows."""
_NONLINEARITIES: tuple[Nonlinearity, ...] = get_args(Nonlinearity)

_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
             nn.ConvTranspose3d, nn.Embedding, nn.Bilinear)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)


@torch.no_grad()
def init_weights(model: nn.Module, scheme: InitScheme = "xavier", *, std: float = 0.02,
                 nonlinearity: str | None = None) -> nn.Module:
    """Re-initialise ``model`` in place and return it.

    The weights of linear, convolution (and transposed), bilinear and embedding layers are drawn
    by ``scheme``; their biases are set to 0 (an embedding's ``padding_idx`` row too); norm
    layers (LayerNorm, GroupNorm, BatchNorm, RMSNorm) get weight 1 and bias 0. Other parameters
    are left as they are. Draws from torch's global RNG (seed it for the same weights).

    ``xavier``
        ``xavier_uniform_`` (Glorot): variance ``gain**2 * 2 / (fan_in + fan_out)``; gain of
        ``nonlinearity`` (default ``"linear"``: 1).
    ``kaiming``
        ``kaiming_normal_`` (He), fan-in mode: std ``gain / sqrt(fan_in)``; gain of
        ``nonlinearity`` (default ``"relu"``: sqrt(2)).
    ``trunc_normal``
        normal with standard deviation ``std`` (0.02, GPT's and ViT's) truncated at ±2 ``std``
        (the drawn values' own std is then about 0.88 ``std``).

    Example:
        >>> import torch.nn as nn
        >>> layer = init_weights(nn.Linear(4, 3), "kaiming")
        >>> float(layer.bias.abs().sum())
        0.0
    """
    if scheme not in ("xavier", "kaiming", "trunc_normal"):
        raise ConfigError(f"init_weights: scheme must be 'xavier', 'kaiming' or 'trunc_normal', got {scheme!r}")
    if not (isinstance(std, (int, float)) and math.isfinite(std) and std > 0):
        raise ConfigError(f"init_weights: std must be a number > 0, got {std!r}")
    gain = _nonlinearity(nonlinearity) if nonlinearity is not None else None
    for module in model.modules():
        if isinstance(module, _WEIGHTED):
            _init_weight(module.weight, scheme, std, gain)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.zero_()
            padding = getattr(module, "padding_idx", None)
            if padding is not None:
                module.weight[padding].zero_()
        elif isinstance(module, _NORMS):
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if isinstance(weight, torch.Tensor):  # None without elementwise_affine
                weight.fill_(1.0)
            if isinstance(bias, torch.Tensor):
                bias.zero_()
    return model


def _nonlinearity(name: str) -> Nonlinearity:
    """``name`` as one of the nonlinearities ``torch.nn.init.calculate_gain`` knows."""
    for known in _NONLINEARITIES:
        if name == known:
            return known
    raise ConfigError(f"init_weights: unknown nonlinearity {name!r}; use e.g. 'relu', 'tanh', 'linear'")


def _init_weight(weight: torch.Tensor, scheme: str, std: float, nonlinearity: Nonlinearity | None) -> None:
    if scheme == "trunc_normal":
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2 * std, b=2 * std)
    elif scheme == "xavier":
        nn.init.xavier_uniform_(weight, gain=nn.init.calculate_gain(nonlinearity or "linear"))
    else:
        nn.init.kaiming_normal_(weight, mode="fan_in", nonlinearity=nonlinearity or "relu")


def drop_path(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Zero each sample of ``x`` (dimension 0) with probability ``p`` and scale the kept ones by
    ``1 / (1 - p)``, so that the expectation is ``x``; ``x`` itself when not training or ``p == 0``."""
    if not training or p == 0.0:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class DropPath(nn.Module):
    """Stochastic depth: ``x + DropPath(p)(branch(x))`` skips the branch for a random ``p`` of
    the samples while training, and is the identity in ``eval()``.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> out = DropPath(0.5)(torch.ones(4, 2))
        >>> sorted(set(out[:, 0].tolist())) in ([0.0, 2.0], [2.0], [0.0])  # per sample: dropped or scaled
        True
    """

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0):
            raise ConfigError(f"DropPath: p must be in [0, 1), got {p!r}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
