"""Loads a kvlab checkpoint with h5py into a PyTorch module (docs/checkpoint-format.md).

Usage: load_with_h5py.py CHECKPOINT

The checkpoint holds one Linear layer "proj" with config n_in, n_out and name. Prints, one per
line, for test_checkpoint.cpp to compare:
  name <config name>
  weight_bits <proj.weight as float32 bit patterns, hex, row-major>
  y <proj(x) for x = (1, 2, ..., n_in), %.9g each>
"""
import sys

import h5py
import torch


def load_checkpoint(path):
    """Returns (config dict, state_dict of torch tensors), as in docs/checkpoint-format.md."""
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != "kvlab-checkpoint":
            raise ValueError(f"{path}: not a kvlab checkpoint")
        if f.attrs["format_version"] != 1:
            raise ValueError(f"{path}: unsupported format_version {f.attrs['format_version']}")
        config = {k: (v.item() if hasattr(v, "item") else v) for k, v in f["config"].attrs.items()}
        state_dict = {name: torch.from_numpy(ds[()]) for name, ds in f["model"].items()}
    return config, state_dict


def main():
    config, state_dict = load_checkpoint(sys.argv[1])
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(config["n_in"], config["n_out"])})
    model.load_state_dict(state_dict)  # strict: names and shapes must match
    weight = model["proj"].weight.detach()
    x = torch.arange(1, config["n_in"] + 1, dtype=torch.float32)
    with torch.no_grad():
        y = model["proj"](x)
    print("name", config["name"])
    print("weight_bits", " ".join(f"{b:08x}" for b in weight.numpy().view("uint32").ravel()))
    print("y", " ".join(f"{v:.9g}" for v in y.tolist()))


if __name__ == "__main__":
    main()
