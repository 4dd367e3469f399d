"""A plain DDP training script, as a PyTorch user writes one: no comm hook, no import of ncina.

``torchrun --nproc-per-node N tests/ddp_script.py BACKEND OUTDIR``: the only thing that makes it
train through the aggregator is BACKEND ``ncina`` (torch loads the backend through its entry
point; the job comes from the ``NCINA_*`` variables). Each rank writes ``OUTDIR/rank<R>.json``:
its initial and final parameters as hex floats (bit-exact) and its first and last loss.
tests/test_torch_backend.py runs it.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = 8


def parameters(model: nn.Module) -> list[str]:
    return [float(v).hex() for p in model.parameters() for v in p.detach().flatten()]


def main() -> None:
    backend, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    initial = parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(32, 8, generator=data)
        y = (x[:, 0] > 0).long()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    result = {"initial": initial, "parameters": parameters(model),
              "first_loss": losses[0], "last_loss": losses[-1]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
