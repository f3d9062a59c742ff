"""Benchmark family: bert-large-uncased for sequence classification, as Hugging Face ran it in 2022.

A plain-PyTorch eager equivalent of ``BertForSequenceClassification("bert-large-uncased")``
of transformers 4.1x-4.2x (the setup of the published V100 table in
``shared/data/published_gpu_runs.md``): vocabulary 30522, 24 post-LN encoder layers in an
``nn.ModuleList`` named ``layers``, hidden 1024, 16 heads, FFN 4096 with exact (erf) GELU,
learned position (512) and token-type (2) embeddings, pooler (dense + tanh on the first
token), dropout 0.1 everywhere, a 2-label classifier; 335,143,938 parameters.

Attention is the 2022 eager one: ``scores = q @ k^T / sqrt(64) + mask``, softmax, dropout,
``@ v``. The mask is what ``BertModel`` builds when no ``attention_mask`` is passed (the
benchmark passes none): ones, extended to ``(B, 1, 1, L)`` in the parameters' dtype (fp32),
``(1 - mask) * finfo.min``. Under fp16 autocast the fp16 scores plus this fp32 mask promote to
fp32, as in the real model.

Optimizer: ``transformers.AdamW`` (``adamw_hf``) is a per-parameter loop; torch's AdamW with
``foreach=False`` keeps the same state (two fp32 moments per parameter) and the same
one-parameter-at-a-time temporaries. lr 5e-5, weight decay 0 (Trainer defaults).

Data: random token ids in [100, 30000) of length 512 and random labels, as the benchmark.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

VOCAB = 30522
HIDDEN = 1024
LAYERS = 24
HEADS = 16
FFN = 4096
MAX_POS = 512
SEQ = 512
LABELS = 2
DROPOUT = 0.1
N_SAMPLES = 64
_CACHE = {}

settings = {"global_batch": 4, "epochs": 1, "lr": 5e-5}


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.dropout = nn.Dropout(DROPOUT)
        self.head = HIDDEN // HEADS

    def split(self, x):
        b, t, _ = x.shape
        return x.view(b, t, HEADS, self.head).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.head)
        scores = scores + mask
        probs = self.dropout(F.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(x.shape)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = SelfAttention()
        self.attn_out = nn.Linear(HIDDEN, HIDDEN)
        self.attn_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.intermediate = nn.Linear(HIDDEN, FFN)
        self.output = nn.Linear(FFN, HIDDEN)
        self.out_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.dropout1 = nn.Dropout(DROPOUT)
        self.dropout2 = nn.Dropout(DROPOUT)

    def forward(self, x, mask):
        h = self.attn_norm(self.dropout1(self.attn_out(self.attention(x, mask))) + x)
        return self.out_norm(self.dropout2(self.output(F.gelu(self.intermediate(h)))) + h)


class Bert(nn.Module):
    def __init__(self):
        super().__init__()
        self.word = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
        self.position = nn.Embedding(MAX_POS, HIDDEN)
        self.token_type = nn.Embedding(2, HIDDEN)
        self.emb_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.emb_dropout = nn.Dropout(DROPOUT)
        self.register_buffer("position_ids", torch.arange(MAX_POS).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros((1, MAX_POS), dtype=torch.long), persistent=False)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.pooler = nn.Linear(HIDDEN, HIDDEN)
        self.cls_dropout = nn.Dropout(DROPOUT)
        self.classifier = nn.Linear(HIDDEN, LABELS)

    def forward(self, input_ids):
        b, t = input_ids.shape
        types = self.token_type_ids[:, :t].expand(b, t)
        x = self.word(input_ids) + self.token_type(types)
        x = x + self.position(self.position_ids[:, :t])
        x = self.emb_dropout(self.emb_norm(x))
        # BertModel without an attention_mask: all ones, extended in the parameters' dtype.
        ones = torch.ones((b, t), device=input_ids.device)
        dtype = self.word.weight.dtype
        mask = (1.0 - ones[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        for layer in self.layers:
            x = layer(x, mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(self.cls_dropout(pooled))


def model():
    return Bert()


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 30000, (N_SAMPLES, SEQ), generator=g)
        labels = torch.randint(0, LABELS, (N_SAMPLES,), generator=g)
        _CACHE["train"] = TensorDataset(ids, labels)
    return _CACHE["train"]


def loss(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids).view(-1, LABELS), labels.view(-1))


def optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=5e-5, weight_decay=0.0, foreach=False)


def checkpoint_blocks(model):
    return list(model.layers)
