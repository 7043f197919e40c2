"""Use a converted model: `dsa run` (a completion through llama-cpp-python) and `dsa serve` (the patched llama-server)."""
