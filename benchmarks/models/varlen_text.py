"""Benchmark family: a small causal transformer LM on text of varying length.

Architecture: token embedding (vocab 256, width 64) + learned positions (up to 384) -> 2 pre-LN
blocks (4-head causal self-attention written out as matmuls, so that its T x T scores are
stored, and a 4x GELU MLP) -> LayerNorm -> tied head. About 0.15M parameters.

Quirk exercised: items are sequences of 16-384 tokens, the first ones short (as a corpus
sorted by source or date often is), padded per batch by ``collate`` to the longest item of
the batch (dynamic padding, as NLP fine-tuning does); padded targets are -100, which the
default cross-entropy ignores. A plan made from the first item alone is far too small: the
batch of the longest items holds 24x its tokens, and attention grows with their square.

Data (synthetic, deterministic): 512 sequences, lengths drawn uniformly from 16-384 (seed 0),
then the first 64 items cut to at most 32 tokens; each token is the previous one plus a fixed
random step (mod 256), so that the model has something to learn.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
WIDTH = 64
HEADS = 4
LAYERS = 2
MAX_LEN = 384
N_ITEMS = 512
_CACHE = {}

settings = {"global_batch": 16, "epochs": 1, "lr": 3e-3}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // HEADS)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(MAX_LEN, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def model():
    return LM()


class Texts(torch.utils.data.Dataset):
    def __init__(self, seqs):
        self.seqs = seqs

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        return s[:-1], s[1:]


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(16, MAX_LEN + 1, (N_ITEMS,), generator=g)
        lengths[:64] = lengths[:64].clamp(max=32)
        step = torch.randint(1, VOCAB, (VOCAB,), generator=g)
        seqs = []
        for n in lengths.tolist():
            s = torch.empty(n + 1, dtype=torch.long)
            s[0] = torch.randint(0, VOCAB, (1,), generator=g)
            for t in range(1, n + 1):
                s[t] = (s[t - 1] + step[s[t - 1]]) % VOCAB
            seqs.append(s)
        _CACHE["train"] = Texts(seqs)
    return _CACHE["train"]


def collate(items):
    """Pads inputs with 0 and targets with -100 to the longest item of the batch."""
    T = max(len(x) for x, _ in items)
    inputs = torch.zeros(len(items), T, dtype=torch.long)
    targets = torch.full((len(items), T), -100, dtype=torch.long)
    for i, (x, y) in enumerate(items):
        inputs[i, : len(x)] = x
        targets[i, : len(y)] = y
    return inputs, targets


def checkpoint_blocks(m):
    return list(m.blocks)
