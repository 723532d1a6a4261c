"""Make the proof cluster's tiny model locally (no downloads): a random-weight Llama and a byte-level BPE
tokenizer trained here, saved with ``save_pretrained`` so vLLM loads it like any Hugging Face checkpoint.

Run with the vLLM venv's python (it has torch, transformers and tokenizers):

    .venv-vllm/bin/python -m clusters.vllm.make_model [DIR]     # default: .vllm-model/tiny-llama

The lm_head row of the end-of-sequence token is zero, so its logit is exactly 0 while the other 511 are
random: greedy decoding (what the harness sends) never picks it, and every request generates the
``max_tokens`` it asked for, as the workload in the cluster file expects.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_DIR = Path(".vllm-model/tiny-llama")
# Sizes: "tiny" decodes a token in about 2 ms on one CPU thread, so a 64-token answer is generated before
# the API server has streamed much of it and a killed engine rarely cuts a stream; "slow" (about 150 M
# parameters) takes tens of ms per token, like a real model on real hardware relative to its streaming.
PRESETS = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64),
    "slow": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64),
}
SERVED_NAME = "tiny-llama"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
# The roles are literal text: the byte-level tokenizer encodes them like any other text.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MARKER = "made-by.json"  # written last: its presence means the directory is complete


def _training_text() -> list[str]:
    """A few thousand lines of English-like text from the standard library's own docstrings."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    lines = codecs.decode(this.s, "rot13").splitlines()
    for module_name in ("argparse", "json", "pathlib", "subprocess", "asyncio", "http.server", "email"):
        module = __import__(module_name, fromlist=["_"])
        for name in dir(module):
            doc = getattr(getattr(module, name), "__doc__", None)
            if isinstance(doc, str):
                lines.extend(line.strip() for line in doc.splitlines() if line.strip())
    return lines


def train_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, seed: int = 0, preset: str = "tiny") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer), **PRESETS[preset], max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()  # never the greedy choice (module doc)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / MARKER).write_text(json.dumps({"served_name": SERVED_NAME, "seed": seed, "preset": preset,
                                          "vocab_size": len(tokenizer)}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusters.vllm.make_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size (default tiny)")
    parser.add_argument("--force", action="store_true", help="remake even when DIR is complete")
    args = parser.parse_args(argv)
    if (args.dir / MARKER).exists() and not args.force:
        print(f"[make_model] {args.dir} already holds the model (--force remakes it)")
        return 0
    make_model(args.dir, preset=args.preset)
    print(f"[make_model] wrote {args.dir} (served as {SERVED_NAME!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
