"""Two CPU processes (gloo): the stock model and the optimized one under the same wrapper (DDP or
FSDP2's fully_shard), each rank on its own batch; every parameter gradient judged by the accuracy
rule against a float64 copy under the same wrapper. Run by tests/models/test_distributed.py:

    python tests/helpers/dist_worker.py ddp|fsdp2|ddp-lora PORT
        -> one line per rank: "rank R ok N" or "rank R FAIL ..."

ddp-lora: a tiny Llama with peft's LoRA on every linear layer under DDP (the adapters' gradients).
"""

import copy
import faulthandler
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def wrap(model, how):
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # tiny buckets: dynamo's DDPOptimizer splits the graph at them, as it does a real model's (a
        # 1B model's MLP weights, 32 MB each, are cut apart by 25 MB buckets); here every parameter
        # is a bucket of its own, the worst case. The tiny model (0.3 MB) is below DDPOptimizer's
        # first bucket (1 MiB, which no bucket may undercut): lowered
        dist._DEFAULT_FIRST_BUCKET_BYTES = 1024
        return DistributedDataParallel(model, bucket_cap_mb=0.001)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


# a worker still running after this many seconds prints every thread's stack and exits, so that a
# hung collective fails its test with where it hung (the tests wait 900 s)
WATCHDOG_S = 480


def watch():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)


def start(rank, world, port):
    watch()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def leave():
    """Every rank leaves together and the process ends without Python's teardown: destroying a gloo
    group now and then hangs, and gloo's threads can abort a normal exit."""
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def failures(truth, eager, mine) -> tuple[list[str], int]:
    """The accuracy rule on the loss and every gradient: (what fails, how many were judged), from
    (loss, grads) of the float64 truth, the stock model and the optimized one."""
    from kernelgraft.gradcheck import judge

    (tl, tg), (el, eg), (kl, kg) = truth, eager, mine
    verdicts = [judge("loss", tl, kl, el)] + [judge(f"grad {n}", tg[n], kg[n], eg[n]) for n in tg]
    return [str(v) for v in verdicts if not v.ok], len(verdicts)


def run(rank, world, how, port):
    start(rank, world, port)
    import transformers.masking_utils as mu
    from tiny import batch, loss_and_grads, tiny_model

    import kernelgraft

    # build the causal mask under compile, as transformers 5.17 does (5.24 skips it): the attention
    # calls then carry a mask that reaches DDP's later pieces and FSDP2's layer graphs as an input
    mu._ignore_causal_mask_sdpa = lambda *a, **k: False

    # "<how> layers": the optimized model captured per decoder-layer class
    capture = "layers" if how.endswith(" layers") else "whole"
    how = how.removesuffix(" layers")
    if how == "ddp-lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        cfg = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
        stock, how = get_peft_model(tiny_model("llama"), cfg), "ddp"
    else:
        stock = tiny_model("llama")
    truth = copy.deepcopy(stock).to(torch.float64)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture=capture)
    b = batch(seed=rank + 1)  # each rank its own data: the gradients are averaged over both
    bad, judged = failures(
        loss_and_grads(truth, b, truth=True, wrapped=wrap(truth, how)),
        loss_and_grads(stock, b, wrapped=wrap(stock, how)),
        loss_and_grads(mine, b, wrapped=wrap(mine, how)),
    )
    rep = mine.kernelgraft_report
    served = sum(r.replaced for r in rep.sites)
    causal = sum(c.runs[0] for c in rep.mask_checks)
    line = (
        f"rank {rank} {'ok' if not bad else 'FAIL ' + '; '.join(bad)} {judged} served {served} "
        f"sdpa {rep.counts().get('sdpa', 0)} graphs {rep.graphs} checked causal {causal} "
        f"lora {rep.counts().get('lora', 0)} per step {sum(rep.counts().values())}\n"
    )
    # one write of the whole line: the two ranks share the pipe, and print() writes the text and its
    # newline separately (seen interleaved as "...served 12rank 0 ok ...")
    os.write(sys.stdout.fileno(), line.encode())
    leave()


def run_recompute(port):
    """One gloo process, DDP with a bucket per parameter (a cut between every matmul), the inductor
    backend: what the forward saves for the backward, with recompute on and off, beside the
    unwrapped model; and the gradients under DDP against float64 truth (the accuracy rule)."""
    start(0, 1, port)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    # transformers 5.17 computes the rotary embedding under autocast(enabled=False), so its graphs
    # hold autocast switches, and split_module then wants the pieces in graph order (a plan that
    # breaks it is refused, and recompute is lost under DDP): do as 5.17 does here
    from transformers.models.llama import modeling_llama

    rotary = modeling_llama.LlamaRotaryEmbedding.forward

    def under_autocast(self, x, position_ids):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return rotary(self, x, position_ids)

    modeling_llama.LlamaRotaryEmbedding.forward = under_autocast
    from benchlib import saved_for_backward
    from tiny import batch, loss_and_grads, tiny_model

    import kernelgraft

    stock = tiny_model("llama")
    width = stock.config.intermediate_size
    # 32 tokens, as tests/rewriter/test_recompute.py: at 24 inductor's buffers put the MLP output saved for
    # the down projection inside a storage shared with another (counted by storage, it vanished)
    b = batch(B=2, S=16)
    truth = copy.deepcopy(stock).to(torch.float64)
    refs = (
        loss_and_grads(truth, b, truth=True, wrapped=wrap(truth, "ddp")),
        loss_and_grads(stock, b, wrapped=wrap(stock, "ddp")),
    )
    # (recompute, under DDP, ddp_piece_mb): at None kernelgraft cuts where DDP's buckets fill (here
    # at every parameter); at 0.1 MiB it cuts pieces of at least that (a few, for this 0.3 MB model)
    runs = [
        (True, False, None),
        (True, True, None),
        (False, False, None),
        (False, True, None),
        (True, True, 0.1),
    ]
    for recompute, wrapped, piece in runs:
        torch._dynamo.reset()
        # q/k/v and gate/up apart (fuse_projections=False): the tensors and pieces counted here are
        # the unfused graph's; the fused graph under DDP is checked after the loop
        mine = kernelgraft.optimize(
            copy.deepcopy(stock),
            backend="inductor",
            recompute=recompute,
            ddp_piece_mb=piece,
            fuse_projections=False,
        )
        run = wrap(mine, "ddp") if wrapped else mine
        saved = saved_for_backward(run, lambda run=run: run(**b, use_cache=False).loss)
        mlp = sum(1 for _, shape in saved.values() if shape and shape[-1] == width)
        total = sum(n for n, _ in saved.values())
        ok = "-"
        if wrapped:
            bad, _ = failures(*refs, loss_and_grads(mine, b, wrapped=run))
            ok = "ok" if not bad else "FAIL " + "; ".join(bad)
        # nodes moved at DDP's cuts to keep recomputed calls with their readers (the report says)
        cuts = mine.kernelgraft_report.ddp_cuts
        moved = sum(c["moved"] for c in cuts)
        pieces = sum(c.get("pieces", 0) for c in cuts)
        kept = [c["kept_ddp_cut"] for c in cuts if "kept_ddp_cut" in c]  # why a plan was dropped
        print(
            f"recompute {recompute} ddp {wrapped} saved {total} mlp {mlp} moved {moved} kept {kept} grads {ok} "
            f"pieces {pieces} at {piece}",
            flush=True,
        )
    torch._dynamo.reset()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor")  # projections fused
    run = wrap(mine, "ddp")
    bad, _ = failures(*refs, loss_and_grads(mine, b, wrapped=run))
    fused = sum(r.served for r in mine.kernelgraft_report.projections)
    pieces = sum(c.get("pieces", 0) for c in mine.kernelgraft_report.ddp_cuts)
    print(f"projections fused {fused} ddp grads {'ok' if not bad else 'FAIL ' + '; '.join(bad)} pieces {pieces}", flush=True)
    leave()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    if sys.argv[1] == "ddp-recompute":
        run_recompute(int(sys.argv[2]))
    else:
        mp.spawn(run, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)
