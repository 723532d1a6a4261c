"""The Dynamo proof cluster's model directory: a tokenizer and a Llama ``config.json``, no weights.

Dynamo's mocker simulates the engine (scheduling, KV blocks, timing) and needs no weights; the
frontend needs a tokenizer (the prompt's tokens, detokenizing) and a ``config.json`` that names the
architecture (without ``"architectures": ["LlamaForCausalLM"]`` it loops on "missing field
architectures"). The tokenizer is the vLLM proof cluster's byte-level BPE, trained here
(``clusters.vllm.make_model.train_tokenizer``), so nothing is downloaded. Run it with the Dynamo
venv's Python (it has transformers and tokenizers):

    .venv-dynamo/bin/python -m clusters.dynamo.make_model [DIR]     # default: .dynamo-model/tiny-llama
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clusters.vllm.make_model import MARKER, PRESETS, SERVED_NAME, train_tokenizer

DEFAULT_DIR = Path(".dynamo-model/tiny-llama")


def make_model_dir(out: Path) -> Path:
    from transformers import LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out)
    config = LlamaConfig(vocab_size=len(tokenizer), **PRESETS["tiny"], max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    (out / MARKER).write_text(json.dumps({"served_name": SERVED_NAME, "weights": None,
                                          "vocab_size": len(tokenizer)}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusters.dynamo.make_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", nargs="?", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    if (args.dir / MARKER).exists():
        print(f"[make_model] {args.dir} already holds the model directory")
        return 0
    make_model_dir(args.dir)
    print(f"[make_model] wrote {args.dir} (tokenizer + config.json, no weights; served as {SERVED_NAME!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
