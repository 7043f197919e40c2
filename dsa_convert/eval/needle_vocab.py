"""Tokenizers of the torch needle backend: a HF tokenizer directory (`tokenizers`), or a GGUF's own vocab through
llama.cpp (vocab only) in a child process that stays up for the whole run.

The child process is needed because llama.cpp loaded into a process that already holds torch crashes on some CUDA
images (see llama_runner.vocab_tokens_isolated); the needle grid tokenizes many prompts while searching the filler
amount, so the child answers requests over a pipe instead of being started per text.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import BadInputError, DsaError
from .perplexity_common import vocab_adds_bos


class HfVocab:
    """tokenizer.json of a HF checkpoint; BOS first (the needle formats start with it) where the vocab has one."""

    def __init__(self, model_dir: Path):
        from ..dsa.calib import load_tokenizer

        self._tok = load_tokenizer(Path(model_dir))
        self.add_bos, self.bos_id = vocab_adds_bos(Path(model_dir))
        self.eos_id = _hf_eos_id(Path(model_dir), self._tok)

    def tokenize(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + list(ids)   # the needle formats start with BOS

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=True)

    def newline_ids(self) -> list[int]:
        n = self._tok.get_vocab_size(with_added_tokens=True)
        pieces = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=True)
        return [i for i, p in enumerate(pieces) if "\n" in p]

    def close(self) -> None:
        pass


def _hf_eos_id(model_dir: Path, tok) -> int:
    def read(name: str) -> dict:
        p = model_dir / name
        return json.loads(p.read_text()) if p.is_file() else {}

    eos = read("tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        return int(tok.token_to_id(eos))
    for name in ("generation_config.json", "config.json"):
        v = read(name).get("eos_token_id")
        v = v[0] if isinstance(v, list) and v else v
        if isinstance(v, int):
            return v
    return -1


_CHILD = r"""
import json, sys
from dsa_convert.backend.runtime import import_llama_cpp
lc = import_llama_cpp()
from dsa_convert.backend.llama_runner import _quiet_stderr
try:
    with _quiet_stderr(True):
        llm = lc.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
except ValueError as e:
    print(json.dumps({"error": f"llama.cpp cannot read its vocab ({e})"}), flush=True)
    sys.exit(0)
add_bos = bool(llm._model.add_bos_token())
print(json.dumps({"add_bos": add_bos, "eos": int(llm.token_eos()), "n_vocab": int(llm.n_vocab())}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "tokenize":
        # the needle formats start with BOS whatever the vocab adds by default (the reference model's README)
        out = [int(llm.token_bos())] + llm.tokenize(req["text"].encode("utf-8"), add_bos=False, special=False)
    elif req["op"] == "detokenize":
        out = llm.detokenize(req["ids"]).decode("utf-8", errors="replace")
    else:
        out = [i for i in range(llm.n_vocab()) if b"\n" in llm.detokenize([i])]
    sys.stdout.write(json.dumps({"ok": out}) + "\n")
    sys.stdout.flush()
"""


class GgufVocab:
    """A GGUF's vocab in llama.cpp (vocab_only) in a child process; BOS first (the needle formats start with it)."""

    def __init__(self, path: Path):
        from ..backend.runtime import child_python_env

        env = child_python_env()
        self._err = tempfile.TemporaryFile()
        self.path = Path(path)
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._err, text=True, encoding="utf-8", env=env)
        head = self._read()
        if "error" in head:
            self.close()
            raise BadInputError(f"{self.path.name}: {head['error']}")
        self.add_bos, self.eos_id, self.n_vocab = head["add_bos"], head["eos"], head["n_vocab"]

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            self._err.seek(0)
            last = (self._err.read().decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1]
            self.close()
            raise DsaError(f"tokenizing with {self.path.name}'s vocab failed: {last}")
        return json.loads(line)

    def _ask(self, req: dict):
        if self._proc is None:
            raise DsaError("the vocab process is closed")
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        return self._read()["ok"]

    def tokenize(self, text: str) -> list[int]:
        return list(self._ask({"op": "tokenize", "text": text}))

    def detokenize(self, ids) -> str:
        return self._ask({"op": "detokenize", "ids": [int(t) for t in ids]})

    def newline_ids(self) -> list[int]:
        return list(self._ask({"op": "newlines"}))

    def close(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._err.close()


def open_vocab(model_path: Path, tokenizer_dir: Path | None) -> HfVocab | GgufVocab:
    """--tokenizer DIR, else a HF checkpoint dir's own tokenizer, else the GGUF's vocab (through the llama.cpp
    backend)."""
    model_path = Path(model_path)
    if tokenizer_dir is not None:
        if not Path(tokenizer_dir).is_dir():
            raise BadInputError(f"--tokenizer: not a directory: {tokenizer_dir}")
        return HfVocab(Path(tokenizer_dir))
    if model_path.is_dir():
        return HfVocab(model_path)
    try:
        return GgufVocab(model_path)
    except DsaError as e:
        raise BadInputError(f"--backend torch on a GGUF needs --tokenizer HF_DIR (or the llama.cpp backend for the "
                            f"file's own vocab): {e}") from None
