#!/usr/bin/python3
"""Validation loss of kvlab checkpoints on the PyTorch baseline's fixed validation windows.

kvlab's own evaluation and `bench/torch_train.py --eval-full` each draw their fixed windows
from their own generator, and a different draw of windows moves a val loss by a few
thousandths. This loads kvlab checkpoints into the PyTorch model (bench/torch_gpt.py, the same
parameter names) and evaluates them on exactly the windows torch_train.py uses, so a kvlab run
and a PyTorch run of the same config compare on the same data.

  /usr/bin/python3 bench/cross_eval.py --corpus tinyshakespeare.txt \\
      sweep/runs/kv4_seed*/final.h5
"""
import os

os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # must precede the torch import

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import h5py  # noqa: E402
import torch  # noqa: E402

from torch_gpt import GPT, char_corpus, fixed_val_loss  # noqa: E402  (bench/torch_gpt.py)


def load(path, chars):
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != "kvlab-checkpoint":
            sys.exit(f"error: {path}: not a kvlab checkpoint")
        cfg = {k: (v.item() if hasattr(v, "item") else v) for k, v in f["config"].attrs.items()}
        if cfg["tokenizer"] != "char" or cfg["tied"] != 1:
            sys.exit(f"error: {path}: needs a char-level model with a tied head")
        vocab = [chr(c) for c in f["tokenizer/vocab"][()]]  # Unicode code points
        if vocab != chars:
            sys.exit(f"error: {path}: its vocabulary is not the corpus's")
        state = {name: torch.from_numpy(ds[()]) for name, ds in f["model"].items()}
    model = GPT(cfg["vocab_size"], cfg["block_size"], cfg["n_layer"], cfg["n_head"],
                cfg["n_kv_head"], cfg["n_embd"], cfg["mlp_hidden"])
    model.load_state_dict(state)  # strict: every name and shape
    return cfg, model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--corpus", required=True, help="the corpus the checkpoints were trained on")
    ap.add_argument("--eval-batches", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chars, _, val_data = char_corpus(args.corpus)
    rows = []
    for path in args.checkpoints:
        cfg, model = load(path, chars)
        loss = fixed_val_loss(model, val_data, cfg["batch_size"], cfg["block_size"],
                              args.eval_batches)
        rows.append({"checkpoint": path, "n_kv_head": cfg["n_kv_head"], "seed": cfg["seed"],
                     "val_loss_torch_windows": loss})
        print(f"{path}: n_kv_head {cfg['n_kv_head']} seed {cfg['seed']}: val loss {loss:.4f} "
              f"on torch_train.py's {args.eval_batches} fixed batches")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
