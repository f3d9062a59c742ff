"""A small GPT-shaped language model as a model file's source, for tests that need a model
file on disk (distributed runs load it in every process)."""

# A GPT-shaped LM with tied embeddings whose activations dominate its parameters, so that
# gloo's own collective buffers (allocated on its worker thread at timing-dependent moments,
# at most a block's parameters; NCCL allocates none) stay well inside the tolerance.
LM_SOURCE = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=256, d=64, layers=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def model():
    return TinyLM()


def train_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 129), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])
"""
