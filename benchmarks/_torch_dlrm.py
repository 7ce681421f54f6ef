"""Plain-PyTorch side of ``benchmarks/torchrec_vs_recscale.py --baseline torch`` (any machine
with torch; the GPU machines here have torch but no fbgemm-gpu/TorchRec).

``python benchmarks/_torch_dlrm.py JSON_ARGS`` trains DLRM the way facebookresearch/dlrm does
(``dlrm_s_pytorch.py``): one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table, the dot
interaction as a batched matmul and its strict lower triangle, SGD on the dense part. The tables
get exact row-wise Adagrad (as TorchRec's fused optimizer and recscale do) from their sparse
gradients: coalesce, one accumulator per row (mean of the squared row gradient), update only the
rows the batch touched. Prints one JSON line: train and inference examples/s.

Same architecture, initialisation scale aside, as ``torchrec.models.dlrm.DLRM``: bottom MLP
(ReLU after every layer), interaction of the dense vector with the F pooled embeddings, top MLP
(ReLU except the last layer), logits.
"""

from __future__ import annotations

import json
import sys

import _torch_timing
import torch
from torch import nn


def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, a: dict, device: torch.device):
        super().__init__()
        F, V, D = a["tables"], a["rows"], a["dim"]
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(V, D, mode="sum", sparse=True, device=device) for _ in range(F)
        )
        self.bottom = _mlp([a["dense"], *a["bottom"]], last_relu=True).to(device)
        n = F + 1
        self.register_buffer("li", torch.tril_indices(n, n, -1, device=device)[0])
        self.register_buffer("lj", torch.tril_indices(n, n, -1, device=device)[1])
        self.top = _mlp([D + n * (n - 1) // 2, *a["top"]], last_relu=False).to(device)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # (B, D)
        pooled = [t(ids[:, f]) for f, t in enumerate(self.tables)]  # each (B, D)
        z = torch.stack([x, *pooled], dim=1)  # (B, F+1, D)
        zz = torch.bmm(z, z.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, zz], dim=1)).squeeze(-1)


@torch.no_grad()
def rowwise_adagrad_(table: nn.EmbeddingBag, acc: torch.Tensor, lr: float, eps: float = 1e-8):
    """Exact row-wise Adagrad on the rows of ``table``'s sparse gradient (duplicates summed)."""
    g = table.weight.grad.coalesce()
    rows, vals = g.indices()[0], g.values()
    acc.index_add_(0, rows, vals.pow(2).mean(dim=1))
    table.weight.index_add_(0, rows, -lr * vals / (acc[rows].sqrt() + eps).unsqueeze(1))
    table.weight.grad = None


def main() -> None:
    a = json.loads(sys.argv[1])
    torch.manual_seed(0)
    device = torch.device(a.get("device", "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(a["threads"])
    F, V, H, B = a["tables"], a["rows"], a["hotness"], a["batch"]
    model = DLRM(a, device)
    accs = [torch.zeros(V, device=device) for _ in range(F)]
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    opt = torch.optim.SGD(dense_params, lr=a["dense_lr"])
    loss_fn = nn.BCEWithLogitsLoss()

    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(B, a["dense"], generator=g).to(device),
            torch.randint(0, V, (B, F, H), generator=g).to(device),
            torch.randint(0, 2, (B,), generator=g).float().to(device),
        )
        for _ in range(a["num_batches"])
    ]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(i):
        dense, ids, labels = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(dense, ids), labels)
        loss.backward()
        opt.step()
        for t, acc in zip(model.tables, accs, strict=True):
            rowwise_adagrad_(t, acc, a["emb_lr"])
        return loss

    _torch_timing.report(step, model, batches, a, sync=sync, device=str(device))


if __name__ == "__main__":
    main()
