"""The requests of ``pagefleet bench serve``: ``random``, ``shared-prefix``, ``sharegpt`` and
``short-chat``.

The same flags and semantics as ``vllm bench serve`` (``random``, ``sharegpt``) and SGLang's
``generated-shared-prefix``, so figures compare with published ones:

* ``random`` (vLLM): per request an input length drawn from
  ``[floor(L(1-r)), ceil(L(1+r))]`` with ``L = --random-input-len`` less the special tokens
  the server adds, and ``r = --random-range-ratio``; the output length likewise around
  ``--random-output-len`` (at least 1). A prompt is ``--random-prefix-len`` random tokens
  shared by all, then the run ``allowed[(offset + i + k) % len(allowed)]``, decoded to text
  and re-encoded until it is exactly that long (a run that would merge with the prefix's
  last tokens starts one further on: the prefix's tokens are the same in every prompt).
* ``shared-prefix`` (SGLang ``generated-shared-prefix``): ``--gsp-num-groups`` system
  prompts of ``--gsp-system-prompt-len`` random tokens, each followed by
  ``--gsp-prompts-per-group`` questions of ``--gsp-question-len`` tokens
  (``f"{system}\\n\\n{question}"``), ``--gsp-output-len`` tokens out; shuffled. Every prompt
  of a group begins with the same tokens, its system prompt. ``--num-prompts`` does not apply.
* ``sharegpt`` (vLLM): a ShareGPT JSON file (``--dataset-path``): conversations with at
  least two turns, shuffled with the seed; the first turn is the prompt, the second's token
  count (special tokens included, as vLLM counts it) the output length unless
  ``--sharegpt-output-len``; pairs with a prompt or output under 4 tokens, a prompt over
  1024 or a total over 2048 are skipped; too few are topped up by drawing again.
* ``short-chat`` (pagefleet's): short chat turns, where a request's fixed cost (HTTP, the
  hops through Redis, admission) weighs more than its tokens. A prompt is
  ``--short-chat-min-words`` to ``--short-chat-max-words`` words (uniform; default 10-90)
  of seeded pseudo-English (the text the ``--compare`` checkpoint's tokenizer is trained
  on); of the outputs, ``1 - SHORT_CHAT_TAIL`` (90 %) are ``--short-chat-min-output`` to
  ``--short-chat-max-output`` tokens (uniform; default 8-48) and the rest a longer tail, up
  to ``SHORT_CHAT_TAIL_FACTOR`` (4) times the maximum. Meant for ``--max-concurrency 16``.

Everything is generated from ``--seed`` offline: the same seed and tokenizer give the same
requests. ``prompt_len`` is the token count the server sees (its special tokens included).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEPARATOR = "\n\n"  # between a system prompt and its question (SGLang's)


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens the server sees, its special tokens included
    expected_output_len: int
    group: int | None = None  # shared-prefix: the index of the system prompt it starts with


# -- prompts of an exact length ---------------------------------------------------------
def fit_to_length(tok, ids: list[int], target: int, rng: np.random.Generator,
                  max_retry: int = 50) -> tuple[str, list[int]]:
    """Text whose encoding is ``target`` tokens, starting from ``ids``.

    Decoding then encoding can merge or split tokens, so (as vLLM does) re-encode, cut or
    top up with random allowed tokens, and repeat. Returns the text and its encoding, which
    is ``target`` long unless ``max_retry`` rounds did not get there (then the last round's).
    """
    allowed = tok.allowed_ids
    for _ in range(max_retry):
        text = tok.decode(ids)
        ids = tok.encode(text)
        if len(ids) == target:
            return text, ids
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + [allowed[i] for i in rng.integers(0, len(allowed), target - len(ids))]
    text = tok.decode(ids)
    return text, tok.encode(text)


def _random_ids(tok, n: int, rng: np.random.Generator) -> list[int]:
    allowed = tok.allowed_ids
    return [allowed[i] for i in rng.integers(0, len(allowed), n)]


def after_prefix(tok, prefix: str, prefix_ids: list[int], draw, length: int, rng: np.random.Generator,
                 max_retry: int = 50) -> tuple[str, list[int]]:
    """``prefix`` + a text of ``length`` tokens that leaves the prefix's tokens whole: the
    whole encodes to ``prefix_ids`` + the text's own tokens. ``draw(attempt)`` gives the
    token ids to start from; a boundary that merges tokens is tried again from the next
    draw. Returns the whole text and its encoding (after ``max_retry`` failed draws, the
    last one's)."""
    for attempt in range(max_retry):
        text, ids = fit_to_length(tok, draw(attempt), length, rng)
        full = tok.encode(prefix + text)
        if full == prefix_ids + ids:
            break
    return prefix + text, full


# -- random --------------------------------------------------------------------------------------
def random_requests(tok, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    real_input_len = max(0, input_len - tok.num_special_tokens)
    in_lo, in_hi = math.floor(real_input_len * (1 - range_ratio)), math.ceil(real_input_len * (1 + range_ratio))
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_lo < 1:
        raise ValueError(f"--random-input-len {input_len}: prompts of {prefix_len + in_lo} tokens; "
                         f"the server adds {tok.num_special_tokens} special tokens itself")
    input_lens = rng.integers(in_lo, in_hi + 1, num_prompts)
    output_lens = rng.integers(out_lo, out_hi + 1, num_prompts)
    allowed = np.asarray(tok.allowed_ids)
    offsets = rng.integers(0, len(allowed), num_prompts)
    prefix, prefix_ids = fit_to_length(tok, _random_ids(tok, prefix_len, rng), prefix_len, rng)
    out = []
    for i in range(num_prompts):
        n = int(input_lens[i])

        def draw(attempt: int, i: int = i, n: int = n) -> list[int]:
            return allowed[(offsets[i] + i + attempt + np.arange(n)) % len(allowed)].tolist()

        text, ids = after_prefix(tok, prefix, prefix_ids, draw, n, rng)
        out.append(SampleRequest(text, len(ids) + tok.num_special_tokens, int(output_lens[i])))
    return out


# -- shared prefix ---------------------------------------------------------------------------------
def shared_prefix_requests(tok, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                           question_len: int, output_len: int, seed: int = 0,
                           max_retry: int = 50) -> list[SampleRequest]:
    """Redraws a system prompt until its tokens stay whole in front of the separator, and a
    question until it leaves them whole too, so a group's prompts share its system prompt's
    tokens exactly (what prefix caching sees)."""
    rng = np.random.default_rng(seed)
    sep = tok.encode(SEPARATOR)
    out = []
    for g in range(num_groups):
        for _ in range(max_retry):
            system, sys_ids = fit_to_length(tok, _random_ids(tok, system_prompt_len, rng), system_prompt_len, rng)
            if tok.encode(system + SEPARATOR) == sys_ids + sep:
                break
        for _ in range(prompts_per_group):
            text, ids = after_prefix(tok, system + SEPARATOR, sys_ids + sep,
                                     lambda _: _random_ids(tok, question_len, rng), question_len, rng)
            out.append(SampleRequest(text, len(ids) + tok.num_special_tokens, output_len, group=g))
    random.Random(seed).shuffle(out)
    return out


# -- ShareGPT ------------------------------------------------------------------------------------------
def _valid(prompt_len: int, output_len: int, check_output: bool) -> bool:
    """vLLM's pruning: at least 4 tokens each way, a prompt of at most 1024, in all at most 2048."""
    return (prompt_len >= 4 and (not check_output or output_len >= 4) and prompt_len <= 1024
            and prompt_len + output_len <= 2048)


def sharegpt_requests(tok, path: str | Path, num_prompts: int, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    data = [e for e in data if len(e.get("conversations", ())) >= 2]
    rng = random.Random(seed)
    rng.shuffle(data)
    special = tok.num_special_tokens
    out: list[SampleRequest] = []
    for entry in data:
        if len(out) >= num_prompts:
            break
        prompt, completion = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len = len(tok.encode(prompt)) + special
        n_out = len(tok.encode(completion)) + special if output_len is None else output_len
        if _valid(prompt_len, n_out, check_output=output_len is None):
            out.append(SampleRequest(prompt, prompt_len, n_out))
    if not out:
        raise ValueError(f"{path}: no conversation fits (two turns, prompt 4-1024 tokens, total <= 2048)")
    if len(out) < num_prompts:  # vLLM oversamples: draw again from what fits
        out += rng.choices(out, k=num_prompts - len(out))
    return out


# -- short chat ------------------------------------------------------------------------------------------
SHORT_CHAT_TAIL = 0.1  # the share of outputs longer than --short-chat-max-output
SHORT_CHAT_TAIL_FACTOR = 4  # ... up to this many times it


def short_chat_requests(tok, num_prompts: int, min_words: int = 10, max_words: int = 90,
                        min_output: int = 8, max_output: int = 48, seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` chat turns of ``min_words``-``max_words`` words (whitespace-separated)
    and outputs mostly of ``min_output``-``max_output`` tokens (see the module's docstring)."""
    from .checkpoint import generated_text

    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    if not 1 <= min_words <= max_words:
        raise ValueError(f"short-chat: need 1 <= --short-chat-min-words ({min_words}) "
                         f"<= --short-chat-max-words ({max_words})")
    if not 1 <= min_output <= max_output:
        raise ValueError(f"short-chat: need 1 <= --short-chat-min-output ({min_output}) "
                         f"<= --short-chat-max-output ({max_output})")
    rng = np.random.default_rng(seed)
    num_words = rng.integers(min_words, max_words + 1, num_prompts)
    tail = rng.random(num_prompts) < SHORT_CHAT_TAIL
    output_lens = np.where(tail, rng.integers(max_output + 1, SHORT_CHAT_TAIL_FACTOR * max_output + 1, num_prompts),
                           rng.integers(min_output, max_output + 1, num_prompts))
    words = iter(w for sentence in generated_text(seed, num_sentences=10 ** 9) for w in sentence.split())
    special = tok.num_special_tokens
    out = []
    for n, n_out in zip(num_words, output_lens, strict=True):
        prompt = " ".join(next(words) for _ in range(int(n)))
        out.append(SampleRequest(prompt, len(tok.encode(prompt)) + special, int(n_out)))
    return out


# -- from the command line ---------------------------------------------------------------------------
def add_dataset_args(p) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random",
                   choices=("random", "shared-prefix", "sharegpt", "short-chat"), help="where the requests come from")
    g.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT JSON file")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send (not shared-prefix)")
    g.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival times")
    g.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="random: output tokens")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn from [L(1-r), L(1+r)]")
    g.add_argument("--random-prefix-len", type=int, default=0, help="random: tokens every prompt begins with")
    add_shared_prefix_args(g)
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens of every request (default: the reply's)")
    g.add_argument("--short-chat-min-words", type=int, default=10, help="short-chat: fewest words in a prompt")
    g.add_argument("--short-chat-max-words", type=int, default=90, help="short-chat: most words in a prompt")
    g.add_argument("--short-chat-min-output", type=int, default=8,
                   help="short-chat: fewest output tokens of most requests")
    g.add_argument("--short-chat-max-output", type=int, default=48,
                   help=f"short-chat: most output tokens of most requests ({round(100 * (1 - SHORT_CHAT_TAIL))} %%; "
                        f"the rest up to {SHORT_CHAT_TAIL_FACTOR}x this)")


def add_shared_prefix_args(parser, num_groups: int = 64, prompts_per_group: int | None = 16,
                           system_prompt_len: int = 2048, question_len: int = 128, output_len: int = 256) -> None:
    """The shared-prefix workload's flags, one spelling for every command: SGLang's ``--gsp-*``
    (``args.gsp_num_groups`` ...); the older ``--sp-*`` spelling is still accepted.
    ``prompts_per_group=None``: the caller sets it (no flag)."""
    flags = [("num-groups", "groups", num_groups, "system prompts (groups)"),
             ("prompts-per-group", "prompts-per-group", prompts_per_group, "questions per system prompt"),
             ("system-prompt-len", "system-len", system_prompt_len, "tokens of a system prompt"),
             ("question-len", "question-len", question_len, "tokens of a question"),
             ("output-len", "output-len", output_len, "output tokens per request")]
    for name, old, default, what in flags:
        if default is not None:
            parser.add_argument(f"--gsp-{name}", f"--sp-{old}", type=int, default=default, help=f"shared-prefix: {what}")


def sample_requests(args, tok) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return random_requests(tok, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.random_prefix_len, args.seed)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(tok, args.gsp_num_groups, args.gsp_prompts_per_group,
                                      args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                      args.seed)
    if args.dataset_name == "short-chat":
        return short_chat_requests(tok, args.num_prompts, args.short_chat_min_words, args.short_chat_max_words,
                                   args.short_chat_min_output, args.short_chat_max_output, args.seed)
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    return sharegpt_requests(tok, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed)
