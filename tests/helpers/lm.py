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

# A Llama-shaped LM (attention with q/k/v/o projections and a head count its forward reshapes
# by, a gated MLP), for tensor parallelism: the split the names imply is inferred.
ATTENTION_LM_SOURCE = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d // n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate_proj = nn.Linear(d, 4 * d, bias=False)
        self.up_proj = nn.Linear(d, 4 * d, bias=False)
        self.down_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d)
        self.attn = Attention(d, n_heads)
        self.mlp_norm = nn.RMSNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class AttentionLM(nn.Module):
    def __init__(self, vocab=256, d=64, n_heads=4, layers=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, n_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def model():
    return AttentionLM()


def train_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 65), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


def val_data():  # 9 items: not an even share for 2 replicas
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (9, 65), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])
"""
