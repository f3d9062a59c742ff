"""Benchmark family: 2-layer LSTM sequence classifier with an embedding.

Architecture: ``nn.Embedding(1000, 128)`` -> ``nn.LSTM(128, 256,
num_layers=2, batch_first=True, dropout=0.1)`` -> LayerNorm of the last
layer's final hidden state -> Linear to 5 classes. About 1.05M parameters.

Quirks exercised: a recurrent module whose weights live in
``_flat_weights`` (re-initialised by ``RNNBase._apply`` after ``to()`` /
``to_empty()``), a fused multi-layer RNN kernel whose saved activations
(gates and hidden states for all 64 time steps and both layers) are not
visible as separate autograd nodes, the tuple output (output, (h_n, c_n)).

Data (synthetic, deterministic): 2048 sequences of 64 int64 tokens in
[0, 1000); label (int64, 5 classes) = number of tokens < 100 in the
sequence, bucketed into 5 bins (<=4, 5, 6, 7-8, >=9), so the task is
learnable.
"""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

VOCAB_SIZE = 1000
EMBED = 128
HIDDEN = 256
NUM_LAYERS = 2
NUM_CLASSES = 5
SEQ_LEN = 64
N_SAMPLES = 2048
_SEED = 0
_CACHE = {}

settings = {"global_batch": 32, "epochs": 1, "lr": 2e-3}


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, EMBED)
        self.lstm = nn.LSTM(
            EMBED, HIDDEN, num_layers=NUM_LAYERS, batch_first=True, dropout=0.1
        )
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, tokens):
        _, (h_n, _) = self.lstm(self.embed(tokens))
        return self.head(self.norm(h_n[-1]))


def model():
    return LSTMClassifier()


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        x = torch.randint(0, VOCAB_SIZE, (N_SAMPLES, SEQ_LEN), generator=g)
        # ~6.4 tokens < 100 per sequence on average; classes for counts
        # <=4, 5, 6, 7-8, >=9 (470/295/329/583/371 of the 2048 samples).
        count = (x < 100).sum(dim=1)
        y = torch.bucketize(count, torch.tensor([5, 6, 7, 9]), right=True)
        _CACHE["train"] = TensorDataset(x, y)
    return _CACHE["train"]
