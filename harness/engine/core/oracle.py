"""The oracle: a dense, unpaged, unbatched greedy generation with the same model.

The harness checks every completion of the reference engine token-exactly against this.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from harness.engine.core.config import ModelConfig
from harness.engine.core.model import DenseKV, load_model, torch_threads
from harness.engine.core.output import OutputTracker
from harness.engine.core.types import SamplingParams
from harness.engine.core.tokenizer import ByteTokenizer


def greedy_reference(preset: str, prompt_token_ids: Sequence[int], max_tokens: int,
                     stop: Sequence[str] = (), ignore_eos: bool = False,
                     resume_token_ids: Sequence[int] = (), max_model_len: int | None = None,
                     dtype: str | None = None) -> list[int]:
    """Greedy output token ids of ``preset`` for a prompt, with the engine's stop rules.

    With ``resume_token_ids`` the generation continues after them (they count toward
    ``max_tokens``) and only the tokens after them are returned, exactly as the engine streams
    them. ``max_model_len`` defaults to the preset's ``max_seq_len``.
    """
    tokenizer = ByteTokenizer()
    prompt, resume = list(prompt_token_ids), list(resume_token_ids)
    tokenizer.validate(prompt)
    tokenizer.validate(resume, "resume_token_ids")
    # load suites check many completions of the same few prompts: remember the answers
    return list(_generate(preset, tuple(prompt), max_tokens, tuple(stop), ignore_eos, tuple(resume),
                          max_model_len, dtype))


@functools.lru_cache(maxsize=4096)
def _generate(preset: str, prompt: tuple[int, ...], max_tokens: int, stop: tuple[str, ...], ignore_eos: bool,
              resume: tuple[int, ...], max_model_len: int | None, dtype: str | None) -> tuple[int, ...]:
    cfg = ModelConfig.from_name(preset, **({"dtype": dtype} if dtype else {}))
    tokenizer = ByteTokenizer()
    prompt, resume = list(prompt), list(resume)
    params = SamplingParams(max_tokens=max_tokens, stop=tuple(stop), ignore_eos=ignore_eos)
    tracker = OutputTracker(tokenizer, params, len(prompt), max_model_len or cfg.max_seq_len, resume)
    model = load_model(cfg, "cpu")
    kv = DenseKV(cfg.n_layers)
    pending = prompt + resume  # tokens whose K/V are not cached yet
    with torch_threads(1):  # small matmuls: extra threads only spin on a shared machine
        while not tracker.finished:
            start = kv.length()
            hidden = model.forward(model.tensor(pending), torch.arange(start, start + len(pending)), kv)
            token = int(torch.argmax(model.logits(hidden[-1:])[0]).item())
            tracker.append(token)
            pending = [token]
    return tuple(tracker.output_ids[len(resume):])


greedy_reference.cache_clear = _generate.cache_clear  # type: ignore[attr-defined]
