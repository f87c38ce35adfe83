"""Build the tiny CPU model and the arithmetic data: `python -m toy.make_tiny` (from the repo root).

Writes toy/models/tiny-qwen3/ (a random 2-layer Qwen3 with a character tokenizer, float32 safetensors;
no download) and toy/data/arith_{train,val,test}.jsonl (two-number +/- problems; validation and test
problems are disjoint from the training ones). Tests import build_tiny_model and make_arith_rows.
"""
import argparse
import json
import random
import sys
from pathlib import Path

import torch

import mipu

HERE = Path(__file__).resolve().parent
# rows, seed; train first (val and test skip its prompts). 800 distinct problems exist (a, b in 0..19, +/-).
TOY_DATA = {"arith_train.jsonl": (512, 1), "arith_val.jsonl": (128, 2), "arith_test.jsonl": (128, 3)}
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3
# every character a tiny arithmetic prompt/answer (and a \boxed{} answer) can contain
CHARS = list("0123456789+-*/=.,:()\\{} ") + list("abcdefghijklmnopqrstuvwxyz")


def make_arith_rows(n: int, seed: int) -> list[dict]:
    """n tiny problems "a+b=" / "a-b=" with a, b in 0..19 (short enough for a char model)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 19), rng.randint(0, 19)  # 0..19: answers have <= 2 digits
        op = rng.choice("+-")
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a - b)})
    return rows


def write_jsonl(rows: list[dict], path: str) -> None:
    """Write rows as one JSON object per line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def build_char_tokenizer():
    """A char-level WordLevel tokenizer wrapped in PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # split into single characters (space included) so every char is one token
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join chars back without inserting spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                   eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")


def build_tiny_model(out_dir: str, seed: int = 0) -> None:
    """Save a tiny random Qwen3 (float32 safetensors) + char tokenizer to out_dir."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=64,  # 4 specials + 50 chars, padded to 64 (real Qwen3 pads its vocab too)
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA as in real Qwen3
        head_dim=32,  # vLLM CPU attention rejects head_dim=16 (VLLM_CPU.md)
        intermediate_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=True,  # as Qwen3-0.6B..4B; vLLM loads tied Qwen3 fine
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def make_tiny(out: str, seed: int) -> None:
    build_tiny_model(out, seed=seed)
    seen = set()
    for name, (n, data_seed) in TOY_DATA.items():
        rows = [r for r in make_arith_rows(4 * n, data_seed) if r["prompt"] not in seen][:n]
        seen |= {r["prompt"] for r in rows} if name == "arith_train.jsonl" else set()
        write_jsonl(rows, str(HERE / "data" / name))
    print(f"wrote {out} and toy/data/{', toy/data/'.join(TOY_DATA)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE / "models" / "tiny-qwen3"), help="where to write the tiny model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()
    sys.exit(mipu.report_errors(make_tiny, args.out, args.seed))
