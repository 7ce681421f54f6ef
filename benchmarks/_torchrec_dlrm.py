"""TorchRec side of ``benchmarks/torchrec_vs_recscale.py`` (runs in TorchRec's own venv).

``python benchmarks/_torchrec_dlrm.py JSON_ARGS`` trains TorchRec's DLRM (``torchrec.models.dlrm``)
with its fused embedding optimizer (fbgemm TBE CPU kernels: exact row-wise Adagrad applied in the
backward, no dense table gradient) and SGD on the dense part, on pre-generated random batches,
and prints one JSON line: train and inference examples/s.
"""

from __future__ import annotations

import json
import sys

import _torch_timing
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.modules.fused_embedding_modules import fuse_embedding_optimizer
from torchrec.optim import RowWiseAdagrad


def main() -> None:
    a = json.loads(sys.argv[1])
    torch.manual_seed(0)
    torch.set_num_threads(a["threads"])
    F, V, D, H, B = a["tables"], a["rows"], a["dim"], a["hotness"], a["batch"]
    names = [f"f{i}" for i in range(F)]
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=D, num_embeddings=V, feature_names=[names[i]]
            )
            for i in range(F)
        ],
        device=torch.device("cpu"),
    )
    model = DLRM(ebc, a["dense"], list(a["bottom"]), list(a["top"]))
    model = fuse_embedding_optimizer(
        model, RowWiseAdagrad, {"lr": a["emb_lr"]}, torch.device("cpu")
    )
    dense_params = [p for n, p in model.named_parameters() if "embedding" not in n]
    opt = torch.optim.SGD(dense_params, lr=a["dense_lr"])
    loss_fn = torch.nn.BCEWithLogitsLoss()

    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(a["num_batches"]):
        dense = torch.randn(B, a["dense"], generator=g)
        values = torch.randint(0, V, (B * F * H,), generator=g)
        lengths = torch.full((F * B,), H, dtype=torch.int32)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=values, lengths=lengths)
        labels = torch.randint(0, 2, (B,), generator=g).float()
        batches.append((dense, kjt, labels))

    def step(i):
        dense, kjt, labels = batches[i % len(batches)]
        opt.zero_grad()
        logits = model(dense, kjt).squeeze(-1)
        loss = loss_fn(logits, labels)
        loss.backward()
        opt.step()
        return loss

    _torch_timing.report(step, model, batches, a)


if __name__ == "__main__":
    main()
