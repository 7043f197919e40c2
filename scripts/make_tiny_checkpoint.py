#!/usr/bin/env python3
"""A small random Llama checkpoint in HF layout (for the demo when ../shared is absent), or, with
--calib-text OUT / --eval-text OUT, filler text files (different seeds) for machines without ../shared.
Prints the path."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("--calib-text", "--eval-text"):
        out = Path(sys.argv[2])
        import random

        rng = random.Random(0 if sys.argv[1] == "--calib-text" else 1)
        words = "the of and to in a is that was he for it with as his on be at by had not are but from".split()
        out.write_text("\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(4000)))
        print(out)
        return
    from conftest import make_tiny_model

    print(make_tiny_model(Path(sys.argv[1]), "llama-llama3rope-tied-sharded"))


if __name__ == "__main__":
    main()
