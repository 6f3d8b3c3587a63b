#!/usr/bin/env bash
# The Debian packages tests/gpu/run.sh unpacks on a GPU machine that lacks
# LuaJIT, libuv and OpenBLAS (the device tool's machine: no package registry
# there), downloaded here into .debs/ (git-ignored; ~13 MB): carry it with
# the run, e.g. run(command='tests/gpu/run.sh', carry=['.debs']).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .debs
cd .debs
apt-get download libluajit2-5.1-dev libluajit2-5.1-2 libluajit2-5.1-common libuv1-dev libuv1 libopenblas-dev \
  libopenblas0-pthread libopenblas0 libopenblas-pthread-dev libgfortran5
ls -l
