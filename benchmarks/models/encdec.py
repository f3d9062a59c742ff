"""Benchmark family: encoder-decoder transformer for sequence-to-sequence.

Architecture: separate source/target token embeddings plus learned position
embeddings; an encoder ``nn.ModuleList`` of 2 pre-LN blocks (bidirectional
self-attention + MLP) and a decoder ``nn.ModuleList`` of 2 pre-LN blocks
(causal self-attention, cross-attention over the encoder output, MLP), all
attention through ``nn.MultiheadAttention(batch_first=True)``; final
LayerNorms and an untied output projection. Width 128, 4 heads, vocab 512,
source and target length 32: about 1.13M parameters.

Quirks exercised: a batch that is a 3-tuple (src, tgt_in, tgt_out) with a
custom ``loss(model, batch)``; two input sequences; the encoder output is
kept alive for every decoder layer's cross-attention; a causal mask built
in forward (bool, True = masked) passed to ``nn.MultiheadAttention``.

Data (synthetic, deterministic): 2048 pairs; src = 32 random tokens in
[2, 512), tgt = src reversed; tgt_in = [BOS=1] + tgt[:-1], tgt_out = tgt;
all int64 of shape (32,).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

VOCAB_SIZE = 512
BOS = 1
SEQ_LEN = 32
D_MODEL = 128
N_HEAD = 4
N_ENC = 2
N_DEC = 2
N_SAMPLES = 2048
_SEED = 0
_CACHE = {}

settings = {"global_batch": 32, "epochs": 1, "lr": 1e-3}


def _mlp(d):
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class EncoderBlock(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = _mlp(d)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.self_attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class DecoderBlock(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.cross_attn = nn.MultiheadAttention(d, n_head, batch_first=True)
        self.ln3 = nn.LayerNorm(d)
        self.mlp = _mlp(d)

    def forward(self, x, memory, causal_mask):
        h = self.ln1(x)
        x = x + self.self_attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        h = self.ln2(x)
        x = x + self.cross_attn(h, memory, memory, need_weights=False)[0]
        return x + self.mlp(self.ln3(x))


class Seq2SeqTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.src_emb = nn.Embedding(VOCAB_SIZE, D_MODEL)
        self.tgt_emb = nn.Embedding(VOCAB_SIZE, D_MODEL)
        self.src_pos = nn.Embedding(SEQ_LEN, D_MODEL)
        self.tgt_pos = nn.Embedding(SEQ_LEN, D_MODEL)
        self.encoder = nn.ModuleList(EncoderBlock(D_MODEL, N_HEAD) for _ in range(N_ENC))
        self.decoder = nn.ModuleList(DecoderBlock(D_MODEL, N_HEAD) for _ in range(N_DEC))
        self.enc_ln = nn.LayerNorm(D_MODEL)
        self.dec_ln = nn.LayerNorm(D_MODEL)
        self.out = nn.Linear(D_MODEL, VOCAB_SIZE)

    def encode(self, src):
        pos = torch.arange(src.shape[1], device=src.device)
        x = self.src_emb(src) + self.src_pos(pos)
        for block in self.encoder:
            x = block(x)
        return self.enc_ln(x)

    def decode(self, tgt_in, memory):
        T = tgt_in.shape[1]
        pos = torch.arange(T, device=tgt_in.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt_in.device).triu(1)
        x = self.tgt_emb(tgt_in) + self.tgt_pos(pos)
        for block in self.decoder:
            x = block(x, memory, causal)
        return self.out(self.dec_ln(x))

    def forward(self, src, tgt_in):
        return self.decode(tgt_in, self.encode(src))


def model():
    return Seq2SeqTransformer()


def loss(model, batch):
    src, tgt_in, tgt_out = batch
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        src = torch.randint(2, VOCAB_SIZE, (N_SAMPLES, SEQ_LEN), generator=g)
        tgt = src.flip(1)
        tgt_in = torch.cat([torch.full((N_SAMPLES, 1), BOS), tgt[:, :-1]], dim=1)
        _CACHE["train"] = TensorDataset(src, tgt_in, tgt.contiguous())
    return _CACHE["train"]
