"""bert-large (see ``bert_large.py``) trained with Adafactor, as the published table's Adafactor rows.

The table used the HF Trainer's ``adafactor=True``: ``transformers.Adafactor(lr=5e-5,
scale_parameter=False, relative_step=False, warmup_init=False)``, i.e. Adafactor (Shazeer and
Stern, 2018) without a first moment: a factored second moment (a row and a column vector per
matrix, a full one for vectors), the update clipped by its RMS, a loop over parameters.
:class:`Adafactor` below is that algorithm, written with the same tensor operations, so that its
per-parameter temporaries (``grad**2 + eps``, the reconstructed second moment, the update) are
traced. ``torch.optim.Adafactor`` is not used: it reads ``param.norm().item()`` each step,
which fake tensors cannot trace, and its temporaries differ.
"""

import math

import torch

from bert_large import checkpoint_blocks, loss, model, settings, train_data  # noqa: F401


class Adafactor(torch.optim.Optimizer):
    def __init__(self, params, lr=5e-5, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate))

    @staticmethod
    def _rms(t):
        return t.norm(2) / math.sqrt(t.numel())

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            eps1, _ = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                factored = grad.dim() >= 2
                if not state:
                    state["step"] = 0
                    if factored:
                        state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1], dtype=grad.dtype, device=grad.device)
                        state["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:], dtype=grad.dtype,
                                                              device=grad.device)
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(grad)
                state["step"] += 1
                state["RMS"] = self._rms(p)
                beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
                update = grad**2 + eps1
                if factored:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    c_factor = col.unsqueeze(-2).rsqrt()
                    update = torch.mul(r_factor, c_factor)
                    update.mul_(grad)
                else:
                    exp_avg_sq = state["exp_avg_sq"]
                    exp_avg_sq.mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = exp_avg_sq.rsqrt().mul_(grad)
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(group["lr"])
                p.add_(-update)


def optimizer(parameters):
    return Adafactor(parameters, lr=5e-5)
