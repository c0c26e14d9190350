#!/usr/bin/env python3
"""The layer check refuses what it exists to refuse: on a copy of the tree, an include of a
layer above (nn/ or report/ naming infer/, serve/ naming the measurement code or apps/) and
the BLAS's header in apps/ each fail it, naming the file, while the unchanged copy passes.

usage: test_check_layers.py SOURCE_DIR
"""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check_layers  # noqa: E402  (the folders it checks)


def copy_tree(root, dest):
    os.makedirs(os.path.join(dest, "docs"))
    shutil.copy(os.path.join(root, "docs", "architecture.md"), os.path.join(dest, "docs"))
    for top in check_layers.CHECKED:
        shutil.copytree(os.path.join(root, top), os.path.join(dest, top),
                        ignore=shutil.ignore_patterns("corpora", "node_modules"))


def run_check(tree):
    out = subprocess.run([sys.executable, os.path.join(HERE, "check_layers.py"), tree],
                         capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def expect(ok, message):
    if not ok:
        print(f"FAILED: {message}")
        sys.exit(1)
    print(f"ok: {message}")


def main():
    root = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "tree")
        copy_tree(root, tree)
        rc, out = run_check(tree)
        expect(rc == 0, f"the unchanged copy passes (exit {rc}): {out.strip()}")

        # An upward include into each library: nn naming the runtime, the report naming the
        # runtime, the server naming the measurement code or the command line.
        upward = [("nn", "infer/engine.h", "infer"), ("report", "infer/engine.h", "infer"),
                  ("serve", "infer/measure/bench.h", "measure"), ("serve", "apps/cli.h", "apps")]
        for unit, header, above in upward:
            planted = os.path.join(tree, unit, "planted.h")
            with open(planted, "w") as f:
                f.write(f'#pragma once\n#include "{header}"\n')
            rc, out = run_check(tree)
            expect(rc == 1 and f"{unit}/planted.h:2: {unit} may not include {above}" in out,
                   f"an upward include from {unit}/ into {above} is refused (exit {rc}): "
                   f"{out.strip()}")
            os.remove(planted)

        planted = os.path.join(tree, "apps", "planted.cpp")
        with open(planted, "w") as f:
            f.write("#include <cblas.h>\nint main() { return 0; }\n")
        rc, out = run_check(tree)
        expect(rc == 1 and "apps/planted.cpp:1: apps may not include blas's <cblas.h>" in out,
               f"<cblas.h> in apps/ is refused (exit {rc}): {out.strip()}")
    print(f"{len(upward) + 1} planted includes refused, the clean copy passes")


if __name__ == "__main__":
    main()
