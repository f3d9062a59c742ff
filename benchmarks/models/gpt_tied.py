"""Benchmark family: decoder-only transformer LM with tied embeddings.

Architecture (GPT-2 style, like examples/tiny_gpt.py): token + learned
position embeddings, 4 pre-LN blocks in an ``nn.ModuleList`` named
``blocks`` (causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)`` + GELU MLP), final
LayerNorm, lm head whose weight is TIED to the token embedding. Vocab 1024,
width 128, 4 heads, context 64: about 0.93M parameters, of which the
shared 1024x128 embedding/head matrix is counted once.

Quirks exercised: a parameter used twice (embedding lookup and output
projection; one parameter, one gradient, one set of optimizer states) and
(B, T, V) logits that are large next to the model (B*T*1024 floats plus the
softmax in the loss). The tie is written as ``F.linear(x, self.wte.weight)``
instead of ``self.lm_head.weight = self.wte.weight`` because
``module.to_empty()`` after a meta-device build gives each module its own
new Parameter and would silently untie an attribute-assigned tie.

Data (synthetic, deterministic): 1024 windows x of 64 int64 tokens from a
seeded order-1 Markov chain with a sparse random transition table (so the
LM has something to learn), y = x shifted by one. Default loss: cross-entropy
of (B, T, V) logits against (B, T) targets.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

VOCAB_SIZE = 1024
BLOCK_SIZE = 64
N_LAYER = 4
N_HEAD = 4
N_EMBD = 128
N_SAMPLES = 1024
_SEED = 0
_CACHE = {}

settings = {"global_batch": 32, "epochs": 1, "lr": 1e-3, "weight_decay": 0.1}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        shape = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, N_EMBD)
        self.wpe = nn.Embedding(BLOCK_SIZE, N_EMBD)
        self.blocks = nn.ModuleList(Block(N_EMBD, N_HEAD) for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, std=0.02 / math.sqrt(2 * N_LAYER))

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied lm head


def model():
    return GPT()


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        # Each token has 4 likely successors: a learnable order-1 Markov chain.
        successors = torch.randint(0, VOCAB_SIZE, (VOCAB_SIZE, 4), generator=g)
        seq = torch.empty(N_SAMPLES, BLOCK_SIZE + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB_SIZE, (N_SAMPLES,), generator=g)
        choice = torch.randint(0, 4, (N_SAMPLES, BLOCK_SIZE), generator=g)
        for t in range(BLOCK_SIZE):
            seq[:, t + 1] = successors[seq[:, t], choice[:, t]]
        _CACHE["train"] = TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
    return _CACHE["train"]
