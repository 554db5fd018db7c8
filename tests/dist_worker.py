"""Two CPU processes (gloo): the stock model and the optimized one under the same wrapper (DDP or
FSDP2's fully_shard), each rank on its own batch; every parameter gradient judged by the DESIGN.md
rule against a float64 copy under the same wrapper. Run by tests/test_distributed.py:

    python tests/dist_worker.py ddp|fsdp2 PORT      -> one line per rank: "rank R ok N" or "rank R FAIL ..."
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def wrap(model, how):
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def run(rank, world, how, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tiny import batch, loss_and_grads, tiny_model

    import kernelgraft
    from kernelgraft.gradcheck import judge

    stock = tiny_model("llama")
    truth = copy.deepcopy(stock).to(torch.float64)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    b = batch(seed=rank + 1)  # each rank its own data: the gradients are averaged over both
    tl, tg = loss_and_grads(truth, b, truth=True, wrapped=wrap(truth, how))
    el, eg = loss_and_grads(stock, b, wrapped=wrap(stock, how))
    kl, kg = loss_and_grads(mine, b, wrapped=wrap(mine, how))
    verdicts = [judge("loss", tl, kl, el)] + [judge(f"grad {n}", tg[n], kg[n], eg[n]) for n in tg]
    bad = [str(v) for v in verdicts if not v.ok]
    served = sum(r.replaced for r in mine.kernelgraft_report.sites)
    line = f"rank {rank} {'ok' if not bad else 'FAIL ' + '; '.join(bad)} {len(verdicts)} served {served}\n"
    # one write of the whole line: the two ranks share the pipe, and print() writes the text and its
    # newline separately (seen interleaved as "...served 12rank 0 ok ...")
    os.write(sys.stdout.fileno(), line.encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(run, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)
