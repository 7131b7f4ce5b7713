"""A model of one's own for `dpfsdp-verify run --models my_model:MyModel` (docs/models.md).

It imports nothing of the suite: three methods make a model the gate can check.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class TextClassifier(nn.Module):
    """Token ids and a padding mask in, one label per sequence out."""

    def __init__(self, vocab: int, width: int, classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids, mask):
        h = self.norm(self.embed(ids))                      # [n, length, width]
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)   # mean over the real tokens
        return self.head(torch.tanh(self.hidden(pooled)))   # [n, classes]


class MyModel:
    # dim 0 of every parameter (29, 11, 5) is uneven at 2, 3 and 4 ranks: FSDP's shards are too
    vocab, length, width, classes = 29, 6, 11, 5

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)                             # the same weights for the same seed
        return TextClassifier(self.vocab, self.width, self.classes)

    def batch(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, self.vocab, (n, self.length), generator=g)
        lengths = torch.randint(1, self.length + 1, (n,), generator=g)
        mask = torch.arange(self.length) < lengths.unsqueeze(1)
        ids = ids * mask                                    # 0 = padding
        labels = torch.randint(0, self.classes, (n,), generator=g)
        return {"ids": ids, "mask": mask}, labels           # dict inputs: passed as forward(ids=, mask=)

    def loss(self, output, targets):
        return F.cross_entropy(output, targets, reduction="none")   # one loss per sample: shape [n]
