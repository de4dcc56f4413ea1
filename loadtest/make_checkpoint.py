"""Write a GPT-2-family checkpoint with random weights and the offline GPT-2 tokenizer, for
servers that load only from a directory (`transformers serve`) on machines without a hub.

GPT-2 has no chat template, and `transformers serve` answers /v1/chat/completions with a
500 without one, so the tokenizer is saved with CHAT_TEMPLATE ("role: content" lines, then
"assistant:").

    python -m loadtest.make_checkpoint /tmp/gpt2-random --arch gpt2
    python -m loadtest.make_checkpoint /tmp/gpt2-random-08 --arch gpt2 --init-range 0.08
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from engine.model.loader import KNOWN_CONFIGS, load_tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# The tests' tiny model (tests/conftest.py): 2 layers, 64 wide, GPT-2's vocabulary; weights
# 10x GPT-2's init scale so greedy argmaxes are decisive. Seconds to run anywhere.
TINY = {**KNOWN_CONFIGS["gpt2"], "n_layer": 2, "n_embd": 64, "n_head": 4, "initializer_range": 0.2}
ARCHS = {**KNOWN_CONFIGS, "tiny": TINY}


def make_checkpoint(directory: Path, arch: str = "gpt2", seed: int = 0, init_range: float | None = None) -> Path:
    """init_range: the weights' initializer_range, where not the architecture's."""
    overrides = {} if init_range is None else {"initializer_range": init_range}
    config = transformers.GPT2Config.from_dict({**ARCHS[arch], **overrides})
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer = load_tokenizer("gpt2")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--arch", default="gpt2", choices=sorted(ARCHS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-range", type=float, help="initializer_range (GPT-2's: 0.02)")
    args = parser.parse_args(argv)
    make_checkpoint(args.directory, args.arch, args.seed, args.init_range)
    print(f"wrote {args.arch} with random weights to {args.directory}")


if __name__ == "__main__":
    main()
