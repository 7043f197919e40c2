# Sourced by the GPU harnesses before they build: the system C/C++ compilers for llama.cpp and for nvcc's host side.
# The GPU images set CC / CXX / CUDAHOSTCXX to a GCC under /opt/gcc that links libstdc++ statically, and a backend
# built with it fails `dsa backend build`'s load check (docs/CLI.md, "backend build"). HARNESS_KEEP_COMPILERS=1 keeps
# the environment's compilers.
if [ -z "${HARNESS_KEEP_COMPILERS:-}" ] && [ -x /usr/bin/gcc ] && [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
