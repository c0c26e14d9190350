"""Rewrites a kvlab checkpoint the way a PyTorch user's h5py script would write one.

Usage: rewrite_with_h5py.py IN OUT [--gzip] [--fletcher32]

h5py's defaults throughout: no user block, groups that do not track creation order (h5py lists
their members by name), chunked datasets where a filter is asked for. test_checkpoint_safety.cpp
checks that kvlab loads the result with the same values.
"""
import sys

import h5py


def copy_attrs(src, dst):
    for key, value in src.attrs.items():
        dst.attrs[key] = value


def main():
    src_path, dst_path, *flags = sys.argv[1:]
    filters = {}
    if "--gzip" in flags:
        filters.update(compression="gzip", compression_opts=4, shuffle=True)
    if "--fletcher32" in flags:
        filters.update(fletcher32=True)
    with h5py.File(src_path, "r") as src, h5py.File(dst_path, "w") as dst:
        copy_attrs(src, dst)

        def visit(name, obj):
            if isinstance(obj, h5py.Group):
                copy_attrs(obj, dst.create_group(name))
            else:
                data = obj[()]
                dst.create_dataset(name, data=data, **(filters if data.ndim else {}))
                copy_attrs(obj, dst[name])

        src.visititems(visit)


if __name__ == "__main__":
    main()
