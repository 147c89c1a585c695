"""``pagefleet bench structured``: what structured output costs the worker.

On a checkpoint made here with dummy weights (Llama, 2 layers, hidden size 128) and a
byte-level BPE vocabulary of 128,256 tokens (built from merges, no download), it reports:

* host CPU per constrained token: the process CPU time of the step's grammar masks (the
  llguidance bitmask for every constrained row and its application to the logits), divided
  by the rows, p50 and p99 over the steps of ``--num-json`` JSON-schema requests;
* the decode step time with ``--num-seqs`` requests of which half are constrained, against the
  same requests with none (p50 of ``engine.step()`` wall time once all are decoding), with the
  masks computed after the forward (serial) and while it runs (overlapped, the default).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

VOCAB_SIZE = 128_256
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def build_checkpoint(path: Path, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Path:
    """A Llama config (2 layers, hidden 128) and a byte-level BPE tokenizer of ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(alphabet)}
    specials = ["<s>", "</s>"]
    rng = random.Random(seed)
    tokens, merges = list(alphabet), []
    letters = [s for s in alphabet if s.isalpha() and s.isascii()] + ["Ġ"]
    pool = list(letters)
    while len(vocab) < vocab_size - len(specials):
        a = rng.choice(pool if rng.random() < 0.7 else tokens)
        b = rng.choice(letters if rng.random() < 0.6 else pool)
        new = a + b
        if new in vocab or len(new) > 16:
            continue
        vocab[new] = len(vocab)
        merges.append((a, b))
        tokens.append(new)
        if len(new) <= 6:
            pool.append(new)
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
              "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def mask_cost(path: Path, num_json: int, max_tokens: int) -> dict:
    """Host CPU per constrained token of the grammar masks, over ``num_json`` JSON-schema requests."""
    from pagefleet import Engine, SamplingParams
    from pagefleet.common.sampling_params import StructuredOutputs
    from pagefleet.worker import structured

    per_token: list[float] = []
    inner = structured.apply_grammar_masks

    def timed(logits, rows, reqs):
        start = time.process_time()
        inner(logits, rows, reqs)
        per_token.append((time.process_time() - start) / len(rows))

    engine = Engine(str(path), device="cpu", load_format="dummy", num_blocks=2048)
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured_outputs=so)
              for i in range(num_json)]
    engine.generate(["warm up"], params[:1])
    structured.apply_grammar_masks = timed
    structured.OVERLAP = False  # in line after the forward: the timed call holds all of the masks' work
    try:
        outs = engine.generate([f"request {i}" for i in range(num_json)], params)
    finally:
        structured.apply_grammar_masks = inner
        structured.OVERLAP = True
    valid = sum(_valid(o.text) for o in outs)
    return {"num_requests": num_json, "num_valid": valid, "num_steps": len(per_token),
            "p50_us": 1e6 * _percentile(per_token, 0.5), "p99_us": 1e6 * _percentile(per_token, 0.99)}


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except Exception:
        return False
    return True


def step_time(path: Path, num_seqs: int, constrained: bool, steps: int, overlap: bool = True) -> float:
    """p50 decode step wall time (s) with ``num_seqs`` requests, half constrained if ``constrained``."""
    from pagefleet import Engine, SamplingParams
    from pagefleet.common.sampling_params import StructuredOutputs
    from pagefleet.worker import structured

    structured.OVERLAP = overlap

    engine = Engine(str(path), device="cpu", load_format="dummy", num_blocks=4096, max_num_seqs=num_seqs)
    so = StructuredOutputs(json=json.dumps({"type": "array", "items": {"type": "integer"}}))
    for i in range(num_seqs):
        use = so if constrained and i % 2 == 0 else None
        engine.add_request(f"request {i}", SamplingParams(max_tokens=steps + 40, temperature=1.0, seed=i,
                                                          ignore_eos=True, structured_outputs=use))
    for _ in range(8):  # prefill and the grammars' compile
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagefleet bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-json", type=int, default=16, help="JSON-schema requests for the mask cost")
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--num-seqs", type=int, default=64, help="requests in the step-time batch")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "ckpt")
        cost = mask_cost(path, args.num_json, args.max_tokens)
        plain = step_time(path, args.num_seqs, False, args.steps)
        serial = step_time(path, args.num_seqs, True, args.steps, overlap=False)
        overlapped = step_time(path, args.num_seqs, True, args.steps, overlap=True)
    result = {"vocab_size": VOCAB_SIZE, "mask_cpu_per_constrained_token": cost,
              "step_s_p50": {"none": plain, "half_constrained_serial": serial,
                             "half_constrained_overlapped": overlapped,
                             "overhead_serial_pct": 100 * (serial - plain) / plain,
                             "overhead_overlapped_pct": 100 * (overlapped - plain) / plain}}
    print(json.dumps(result, indent=2))
    return 0
