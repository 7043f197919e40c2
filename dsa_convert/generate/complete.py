"""`dsa run`: one completion of a prompt through the patched llama.cpp (llama-cpp-python in this process), streamed
as it is generated, with llama.cpp's own timings of the prompt and of the generated tokens.

Sampling is llama.cpp's default chain (top-k 40, top-p 0.95, min-p 0.05, temperature, no repeat penalty); --temp 0 is
greedy, the same tokens llama-server returns for a request with temperature 0."""
from __future__ import annotations

import codecs
import random
import time
from dataclasses import dataclass
from typing import Callable

from ..backend.llama_log import capture_log, parse_kv_log
from ..backend.llama_runner import RunnerOptions, close_model, open_model
from ..backend.runtime import import_llama_cpp
from ..errors import BadInputError
from ..resources import check_threads
from .chat import chat_messages, chat_prompt
from .session import SessionPlan

TOP_K, TOP_P, MIN_P = 40, 0.95, 0.05       # llama.cpp's sampler defaults (common/common.h)
BATCH = 512                                # llama.cpp's default ubatch


@dataclass
class RunOptions:
    prompt: str
    n_predict: int = 128
    temp: float = 0.8
    seed: int | None = None                # None: a random seed (reported)
    threads: int | None = None
    chat: bool = False                     # the prompt is a user turn, formatted with the file's chat template
    system: str | None = None              # with chat: a system turn before it


def read_prompt(prompt: str | None, prompt_file) -> str:
    """The prompt from -p TEXT or -f FILE (exactly one of them)."""
    if (prompt is None) == (prompt_file is None):
        raise BadInputError("give the prompt with -p TEXT or -f FILE (one of them)")
    if prompt_file is None:
        return prompt
    try:
        return prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"-f {prompt_file}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def check_run_options(o: RunOptions) -> None:
    if not o.prompt:
        raise BadInputError("the prompt is empty (-p TEXT or -f FILE)")
    if o.n_predict < 1:
        raise BadInputError(f"--n-predict must be >= 1 (got {o.n_predict})")
    if o.temp < 0:
        raise BadInputError(f"--temp must be >= 0 (got {o.temp})")
    if o.system is not None and not o.chat:
        raise BadInputError("--system is a turn of --chat; add --chat")
    if o.seed is not None and not 0 <= o.seed < 2 ** 32:
        raise BadInputError(f"--seed must be in 0 .. 2^32 - 1 (got {o.seed})")
    check_threads(o.threads)


def sparse_description(sparse_line: str | None, plan: SessionPlan) -> str:
    """The attention mode as llama.cpp logged it when the context was created ("sparse attention: top-k=…")."""
    if sparse_line is None:
        return "dense (no DSA indexer)" if plan.mode["attn"] == "dense" else f"{plan.mode['attn']} (not logged)"
    if sparse_line.startswith("off"):
        why = sparse_line[3:].strip(" ()").removeprefix("dense").strip()       # "off (dense override)" -> "override"
        return f"dense ({why})" if why else "dense"
    return f"{plan.mode['attn']} ({sparse_line})"


def complete(plan: SessionPlan, o: RunOptions, on_text: Callable[[str], None] | None = None) -> dict:
    """Generate up to o.n_predict tokens after o.prompt (stopping at end of generation or the end of the context);
    on_text gets each piece of text as it is decoded. Returns the text and the run's figures."""
    check_run_options(o)
    lc = import_llama_cpp()
    seed = o.seed if o.seed is not None else random.randrange(2 ** 32)
    with capture_log(lc) as log:
        llm = open_model(plan.path, RunnerOptions(n_ctx=plan.n_ctx, n_batch=min(plan.n_ctx, BATCH),
                                                  n_gpu_layers=plan.n_gpu_layers, flash_attn=plan.flash_attn,
                                                  kv_type=plan.kv, kv_overrides=plan.overrides, logits_all=False,
                                                  n_threads=o.threads))
    info = parse_kv_log("".join(log))
    try:
        if o.chat:      # the template writes its own special tokens (BOS included where it has one)
            text = chat_prompt(llm, plan.path, chat_messages(o.prompt, o.system))
            tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        else:
            tokens = llm.tokenize(o.prompt.encode("utf-8"), add_bos=True, special=True)   # as llama-server tokenizes
        if len(tokens) >= plan.n_ctx:
            raise BadInputError(f"the prompt has {len(tokens)} tokens; the context holds {plan.n_ctx} (--ctx)")
        n_new = min(o.n_predict, plan.n_ctx - len(tokens))
        llm.set_seed(seed)
        lc.llama_perf_context_reset(llm._ctx.ctx)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        vocab = llm._model.vocab
        pieces, generated, finish = [], [], "length"
        t0 = time.perf_counter()
        for tok in llm.generate(tokens, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P, temp=o.temp, repeat_penalty=1.0):
            if lc.llama_vocab_is_eog(vocab, tok):
                finish = "stop"
                break
            generated.append(int(tok))
            text = decoder.decode(llm.detokenize([tok]))
            if text:
                pieces.append(text)
                if on_text is not None:
                    on_text(text)
            if len(generated) == n_new:
                break
        tail = decoder.decode(b"", final=True)
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        wall = time.perf_counter() - t0
        perf = lc.llama_perf_context(llm._ctx.ctx)
    finally:
        close_model(llm)
    kv = info.report()
    if finish == "length" and n_new < o.n_predict:
        finish = "context"
    return {"file": str(plan.path), "text": "".join(pieces), "prompt_tokens": len(tokens), "generated_tokens": len(generated),
            "finish_reason": finish, "chat": o.chat, "ctx": plan.n_ctx, "attn": plan.mode["attn"], "top_k": plan.mode["top_k"],
            "sink": plan.mode["sink"], "local": plan.mode["local"], "attention": sparse_description(info.sparse_line, plan),
            "kv": plan.kv, "temp": o.temp, "seed": seed, "n_gpu_layers": plan.n_gpu_layers,
            "flash_attn": plan.flash_attn,
            "prompt_tps": perf.n_p_eval / (perf.t_p_eval_ms / 1e3) if perf.t_p_eval_ms > 0 else None,
            "gen_tps": perf.n_eval / (perf.t_eval_ms / 1e3) if perf.t_eval_ms > 0 else None,
            "prompt_eval_tokens": int(perf.n_p_eval), "eval_tokens": int(perf.n_eval), "seconds": round(wall, 3),
            **kv}


def stats_line(r: dict) -> str:
    """The one-line footer of `dsa run` (stderr)."""
    def tps(v):
        return f"{v:.1f} tok/s" if v else "-"
    bpt = r.get("kv_bytes_per_token")
    return (f"prompt {r['prompt_tokens']} tok, {tps(r['prompt_tps'])} | generated {r['generated_tokens']} tok, "
            f"{tps(r['gen_tps'])} | attention {r['attention']} | KV {r['kv']}"
            + (f", {bpt:.0f} B/token" if bpt else "") + f" | ctx {r['ctx']}, seed {r['seed']}")
