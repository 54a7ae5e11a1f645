"""A small GPT-style character model, trained the way such scripts are usually written.

DDP under torchrun, evaluation on rank 0 only, ``iter_num`` and
``best_val_loss`` in the loop, the next batch drawn before the optimizer step,
a vocabulary in the checkpoint, and "resume from the checkpoint's model
config": the model is built from the configuration saved with the step, read
with ``peek()`` before the process group exists. The text is embedded; nothing
is downloaded.

    torchrun --nproc-per-node=2 examples/train_gpt.py --out-dir run/gpt --max-iters 40

Kill it (SIGKILL, Ctrl-C, preemption) and start the same command again: it
resumes from the newest committed step and reproduces the losses and final
weights of a run never interrupted, bit for bit. With --remote it resumes on a
fresh machine from the bucket, also at another world size (the global batch
is kept by accumulating micro-batches).

What the resume needs besides model and optimizer: ``iter_num`` and
``best_val_loss`` (plain values, the same on every rank: rank 0's evaluation
is broadcast), the per-rank RNG (shardckpt captures it), and the batch the
loop has already drawn for the next step, which is per-rank state: it is kept
in ``shardckpt.PerRank``. Without that, a resume trains on a fresh batch
where the uninterrupted run used the prefetched one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import shardckpt

TEXT = (
    "a checkpoint is a promise made to a future process: whatever happens to this machine, the work done "
    "so far will not be lost. the promise holds only if everything the loop depends on is written down, "
    "the weights and the optimizer, the step counter and the best loss, the random state of every rank, "
    "and the batch already drawn for the next step. keep the promise and a restart is invisible.\n"
)


# ---------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size)).bool(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = self.drop(att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1))
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---------------------------------------------------------------- the script


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out-gpt", help="checkpoints go to OUT_DIR/ckpt")
    p.add_argument("--remote", default=os.environ.get("SHARDCKPT_REMOTE") or None, help="e.g. s3://bucket/gpt")
    p.add_argument("--max-iters", type=int, default=40)
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="per-rank micro-batch")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=8)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--losses", default=None, help="rank 0 appends one JSON line per iteration here")
    p.add_argument("--iter-sleep", type=float, default=0.0, help="seconds to sleep per iteration (for demos)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # Checkpoint settings: these arguments, then any SHARDCKPT_* variable (see the README).
    ckpt = shardckpt.Checkpointer(shardckpt.CheckpointConfig.from_env(
        local_dir=os.path.join(args.out_dir, "ckpt"), remote=args.remote, every_steps=args.save_interval,
        keep_last=2, metadata={"job": "train_gpt"}, run_config=vars(args), micro_batch_size=args.batch_size,
    ))

    # The vocabulary and the model's shape come from the checkpoint when there is one:
    # peek() is a read-only look, and needs no process group yet.
    chars = sorted(set(TEXT))
    model_args = dict(vocab_size=len(chars), block_size=args.block_size, n_layer=args.n_layer,
                      n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    looked = ckpt.peek()
    if looked is not None:
        model_args = dict(looked.values["model_args"])
        saved = looked.values["vocab"]["itos"]  # int keys, as saved
        chars = [saved[i] for i in range(len(saved))]
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}  # index -> character

    dist.init_process_group("gloo")  # "nccl" on GPUs; checkpointing is the same
    rank, world = dist.get_rank(), dist.get_world_size()
    master_process = rank == 0
    torch.manual_seed(1337)  # the same initial weights everywhere
    data = torch.tensor([stoi[c] for c in TEXT], dtype=torch.long)
    n = int(0.9 * len(data))
    train_data, val_data = data[:n], data[n:]
    block_size = model_args["block_size"]

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        source = train_data if split == "train" else val_data
        ix = torch.randint(len(source) - block_size - 1, (args.batch_size,))  # the global RNG, per rank
        x = torch.stack([source[i:i + block_size] for i in ix])
        y = torch.stack([source[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    raw_model = GPT(**model_args)
    model = DistributedDataParallel(raw_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    torch.manual_seed(1337 + rank)  # from here on each rank draws its own batches and dropout masks

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        raw_model.eval()  # the bare module: no collective inside, so rank 0 can run it alone
        out = {}
        for split in ("train", "val"):
            out[split] = sum(raw_model(*get_batch(split)).item() for _ in range(4)) / 4
        raw_model.train()
        return out

    iter_num = 0
    best_val_loss = 1e9
    batch = shardckpt.PerRank(None)  # the batch drawn for the next step: this rank's state
    train_state = {"iter_num": iter_num, "best_val_loss": best_val_loss}
    state = {"model": model, "optimizer": optimizer, "train": train_state, "batch": batch,
             "model_args": model_args, "vocab": {"stoi": stoi, "itos": itos}}
    resumed = ckpt.load(state)
    accum = 1
    if resumed is not None:
        iter_num, best_val_loss = train_state["iter_num"], train_state["best_val_loss"]
        plan = ckpt.last_plan
        accum = plan.accum_steps if plan is not None and plan.accum_steps else 1
        if master_process:
            print(f"[train_gpt] resumed iter {iter_num} (step {resumed}) from {looked.source if looked else '?'}: "
                  f"model {json.dumps(model_args, sort_keys=True)}, best val {best_val_loss:.4f}, "
                  f"world {world}, {accum} micro-batch(es) per step", flush=True)
    X, Y = batch.value if batch.value is not None else get_batch("train")

    while iter_num < args.max_iters:
        lr = args.lr * min(1.0, (iter_num + 1) / 10)  # warmup, computed from iter_num
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            if master_process:
                losses = estimate_loss()
                if losses["val"] < best_val_loss:
                    best_val_loss = losses["val"]
            # Plain values are saved once for all ranks: make them the same everywhere first.
            shared = torch.tensor([best_val_loss], dtype=torch.float64)
            dist.broadcast(shared, 0)
            best_val_loss = shared.item()
        for micro in range(accum):
            # DDP all-reduces the gradients once per optimizer step, at the last micro-batch.
            with model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                loss = model(X, Y) / accum
                X, Y = get_batch("train")  # prefetch the next batch, as the loop would overlap it with compute
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if master_process and args.losses:
            with open(args.losses, "a") as f:
                f.write(json.dumps({"iter": iter_num, "loss": (loss.item() * accum).hex()}) + "\n")
        train_state.update(iter_num=iter_num, best_val_loss=best_val_loss)
        batch.value = (X, Y)
        ckpt.save(state, iter_num)  # every rank, every iteration: the interval decides
        if ckpt.preempted:
            break
        time.sleep(args.iter_sleep)
    if master_process:
        torch.save(raw_model.state_dict(), os.path.join(args.out_dir, "final.pt"))
        print(f"[train_gpt] done at iter {iter_num}, best val {best_val_loss:.4f}", flush=True)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
