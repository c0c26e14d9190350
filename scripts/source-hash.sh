#!/usr/bin/env bash
# One hash of the sources a build is made from (needs no git), so a prebuilt bundle can be
# checked against the tree it travels with.
set -euo pipefail
cd "$(dirname "$0")/.."
find CMakeLists.txt autograd nn data checkpoints train infer apps bench tests -type f \
  \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name CMakeLists.txt \) \
  -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
