"""``memplan init``: a commented model-file template and a config template to start from.

The model file trains as written (synthetic data, no download), so that
``memplan init && memplan fit model.py --config memplan.toml --vram 1GB`` runs on a fresh
clone; each hook is there with a comment saying when memplan calls it and what it may return.
"""

from __future__ import annotations

from pathlib import Path

from estimators import ConfigError

from .._option_sources import config_template

__all__ = ["write_templates", "MODEL_TEMPLATE"]

MODEL_TEMPLATE = '''"""A memplan model file: memplan imports it and calls the functions below.

memplan fit model.py --vram 12GB     # plan the fastest configuration that fits, then train it
memplan estimate model.py -b 32      # one configuration's peak memory, without running it

Replace the synthetic data and the small network with your own; keep the names.
Only model() and train_data() are required.
"""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

# Defaults for this model; the command line and the config file override them. Any training
# option is a key here (see `memplan fit --help`), plus global_batch and target.
settings = {
    "global_batch": 32,          # micro-batch x accumulation x devices stays this
    "epochs": 5,
    "lr": 3e-3,
    "warmup_steps": 10,
    "target": {"metric": "val_accuracy", "value": 0.9},   # reported in summary.json
}


def _data(n, seed):
    # Synthetic and learnable: the class is which of 4 directions a point lies closest to.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    centres = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    y = (x @ centres.T).argmax(dim=1)
    return TensorDataset(x, y)


def model():
    """The network, built on whatever device is current (memplan builds it on `meta` or
    fake tensors when it only estimates, so do not move it to a device here)."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def train_data():
    """A map-style dataset; its items are collated with default_collate (or collate() below)."""
    return _data(2048, seed=1)


def val_data():
    """Optional: validation metrics, best weights and early stopping."""
    return _data(512, seed=2)


# Optional hooks (uncomment to use):
#
# def loss(model, batch):
#     """The training loss, a scalar tensor. Default: cross_entropy(model(inputs), targets)."""
#     inputs, targets = batch
#     return torch.nn.functional.cross_entropy(model(inputs), targets)
#
# def optimizer(parameters):
#     """Receives the trainable parameters. Default: AdamW, no decay on biases and norms."""
#     return torch.optim.AdamW(parameters, lr=3e-3, weight_decay=0.01)
#
# def collate(items):
#     """Turns a list of dataset items into a batch. Default: default_collate."""
#     return torch.utils.data.default_collate(items)
#
# def checkpoint_blocks(model):
#     """The blocks activation checkpointing (and FSDP2) works on. Default: the largest
#     ModuleList/Sequential of repeated blocks."""
#     return list(model.blocks)
'''


def write_templates(directory: str | Path = ".", *, model_name: str = "model.py", config_name: str = "memplan.toml",
                    force: bool = False) -> list[Path]:
    """Write the model-file and config templates into ``directory``; an existing file is kept
    (a one-line error) unless ``force``."""
    folder = Path(directory)
    targets = [(folder / model_name, MODEL_TEMPLATE), (folder / config_name, config_template())]
    existing = [str(p) for p, _ in targets if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
                          "remove them or run memplan init --force")
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in targets:
        path.write_text(text)
    return [p for p, _ in targets]
