"""The tiny Llama model of devtools.tiny_model: deterministic, loadable, and it answers the
validation prompt with exactly EXPECTED under greedy decoding, through a full forward pass."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from devtools import llama_reference
from devtools import tiny_model as tm

# Chosen well below what the builder gets (about 94) and well above what a model with the
# programmed table broken would get by chance.
MIN_MARGIN = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    tm.build(out)
    return out


def read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def encode(model_dir: Path, text: str, *, special: bool) -> list[int]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return list(tok.encode(text, add_special_tokens=special).ids)


def answer(model_dir: Path) -> list[int]:
    """What the engine must generate: EXPECTED's ids (after a space), then EOS."""
    eos = read_json(model_dir / "config.json")["eos_token_id"]
    return [*encode(model_dir, " " + tm.EXPECTED, special=False), eos]


def test_two_builds_are_byte_identical(tmp_path: Path, model_dir: Path) -> None:
    digest = tm.build(tmp_path / "again")
    assert digest == tm.model_digest(model_dir)
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(tm.FILES)
    for name in tm.FILES:
        assert (tmp_path / "again" / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_another_seed_gives_another_model(tmp_path: Path, model_dir: Path) -> None:
    digest = tm.build(tmp_path / "seed1", seed=1)
    assert digest != tm.model_digest(model_dir)
    # Only the weights depend on the seed; the answer does not.
    assert (tmp_path / "seed1" / "tokenizer.json").read_bytes() == \
        (model_dir / "tokenizer.json").read_bytes()
    w = load_file(str(tmp_path / "seed1" / "model.safetensors"))
    config = read_json(tmp_path / "seed1" / "config.json")
    prompt = encode(tmp_path / "seed1", tm.PROMPT, special=True)
    got, _ = llama_reference.reference_generate(w, config, prompt, max_tokens=16)
    assert got == answer(model_dir)


def test_digest_is_the_sha256sum_listing(model_dir: Path) -> None:
    listing = "".join(
        f"{hashlib.sha256((model_dir / name).read_bytes()).hexdigest()}  {name}\n"
        for name in sorted(tm.FILES))
    assert tm.model_digest(model_dir) == "sha256:" + hashlib.sha256(listing.encode()).hexdigest()


def test_digest_changes_with_content(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    before = tm.model_digest(tmp_path)
    (tmp_path / "a").write_text("2")
    assert tm.model_digest(tmp_path) != before


def test_rebuild_replaces_atomically_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"x")
    digest = tm.build(out)
    assert tm.build(out) == digest
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert not (out / "stale.bin").exists()
    # Readable by an engine that runs as another user.
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())


def test_a_bad_answer_is_refused_before_anything_is_published(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # " ok ok": a repeated token needs two successors, which a bigram cannot have.
    monkeypatch.setattr(tm, "EXPECTED", "ok ok")
    with pytest.raises(tm.ModelBuildError, match="repeat"):
        tm.build(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_config_is_a_llama_vllm_cpu_can_run(model_dir: Path) -> None:
    config = read_json(model_dir / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    head_dim = config["head_dim"]
    assert head_dim == config["hidden_size"] // config["num_attention_heads"]
    assert head_dim >= 32
    assert head_dim in tm.CPU_ATTENTION_HEAD_SIZES
    assert config["num_key_value_heads"] == config["num_attention_heads"]
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == config["dtype"] == "float32"
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert config["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert config["bos_token_id"] == tok.token_to_id(tm.BOS)
    assert config["eos_token_id"] == tok.token_to_id(tm.EOS)
    generation = read_json(model_dir / "generation_config.json")
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert generation["bos_token_id"] == config["bos_token_id"]


def test_weights_have_the_llama_names_and_shapes(model_dir: Path) -> None:
    config = read_json(model_dir / "config.json")
    w = load_file(str(model_dir / "model.safetensors"))
    v, h, i = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    expected = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                "lm_head.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        expected |= {p + "input_layernorm.weight": (h,),
                     p + "post_attention_layernorm.weight": (h,),
                     p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                     p + "mlp.down_proj.weight": (h, i)}
        expected |= {p + f"self_attn.{x}_proj.weight": (h, h) for x in "qkvo"}
    assert {k: a.shape for k, a in w.items()} == expected
    assert all(a.dtype == np.float32 for a in w.values())


def test_tokenizer_config_and_chat_template(model_dir: Path) -> None:
    config = read_json(model_dir / "tokenizer_config.json")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == (tm.BOS, tm.EOS)
    assert read_json(model_dir / "special_tokens_map.json")["eos_token"] == tm.EOS
    template = config["chat_template"]
    assert template.startswith("{{ bos_token }}")
    # The generation prompt is the last thing rendered: its last token enters the chain.
    assert template.endswith("{% if add_generation_prompt %}" + tm.GENERATION_PROMPT
                             + "{% endif %}")


def test_answer_tokens_can_form_a_chain(model_dir: Path) -> None:
    prompt = encode(model_dir, tm.PROMPT, special=True)
    assert prompt[0] == read_json(model_dir / "config.json")["bos_token_id"]
    assert prompt.count(prompt[0]) == 1
    body = answer(model_dir)[:-1]
    assert len(body) >= 3  # several decode steps, not one lucky token
    assert len(set(body)) == len(body)
    assert prompt[-1] not in body
    assert encode(model_dir, tm.GENERATION_PROMPT, special=False)[-1] not in body
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.decode(body).strip() == tm.EXPECTED.strip()


def test_bigram_path_alone_follows_the_chain(model_dir: Path) -> None:
    """Embedding -> final RMSNorm -> lm_head, ignoring attention and the MLP."""
    config = read_json(model_dir / "config.json")
    w = load_file(str(model_dir / "model.safetensors"))
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    norm = w["model.norm.weight"]

    def next_token(t: int) -> tuple[int, float]:
        x = embed[t]
        logits = head @ (x / np.sqrt(np.mean(x * x) + config["rms_norm_eps"]) * norm)
        top2 = np.sort(logits)[-2:]
        return int(np.argmax(logits)), float(top2[1] - top2[0])

    t = encode(model_dir, tm.PROMPT, special=True)[-1]
    for want in answer(model_dir):
        t, margin = next_token(t)
        assert t == want
        assert margin > MIN_MARGIN


def greedy(model_dir: Path, ids: list[int]) -> tuple[list[int], float]:
    config = read_json(model_dir / "config.json")
    w = load_file(str(model_dir / "model.safetensors"))
    return llama_reference.reference_generate(w, config, ids, max_tokens=32)


def test_full_forward_pass_answers_the_prompt(model_dir: Path) -> None:
    got, margin = greedy(model_dir, encode(model_dir, tm.PROMPT, special=True))
    assert got == answer(model_dir)
    assert margin > MIN_MARGIN


def test_full_forward_pass_answers_a_chat(model_dir: Path) -> None:
    # What the chat template renders for one user message with add_generation_prompt.
    rendered = (f"{tm.BOS}{tm.IM_START}user\nHello, are you there?{tm.IM_END}\n"
                f"{tm.GENERATION_PROMPT}")
    got, margin = greedy(model_dir, encode(model_dir, rendered, special=False))
    assert got == answer(model_dir)
    assert margin > MIN_MARGIN


def test_another_prompt_gets_another_answer(model_dir: Path) -> None:
    got, _ = greedy(model_dir, encode(model_dir, "The weights are random", special=True))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert len(got) == 32  # no EOS: the chain is only reachable from its entry points
    assert tm.EXPECTED not in tok.decode(got)


def test_reference_forward_pass_is_causal_and_attends(model_dir: Path) -> None:
    """Guards the check above against a forward pass that degenerated into the bigram."""
    config = read_json(model_dir / "config.json")
    w = load_file(str(model_dir / "model.safetensors"))
    ids = encode(model_dir, tm.PROMPT, special=True)
    base = llama_reference.reference_logits(w, config, ids)
    # A later token does not change earlier positions ...
    np.testing.assert_allclose(llama_reference.reference_logits(w, config, [*ids, 7])[:-1], base,
                               rtol=0, atol=1e-3)
    # ... an earlier one does change the last position (attention), a little.
    changed = llama_reference.reference_logits(w, config, [ids[0], 7, *ids[2:]])[-1]
    diff = float(np.max(np.abs(changed - base[-1])))
    assert 1e-4 < diff < 5.0


def test_cli_prints_the_digest_last(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    model_dir: Path) -> None:
    assert tm.main(["--out", str(tmp_path / "m")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == tm.model_digest(tmp_path / "m") == tm.model_digest(model_dir)


def test_weight_count_is_what_the_builder_writes() -> None:
    """The tiny model's tensors hold exactly `Shape.weight_count` weights: the count the large
    size's bound below is computed with."""
    tok = tm.train_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    weights = tm.make_weights(vocab, tm.successor_table(tok, 0), 0, tm.TINY)
    assert sum(a.size for a in weights.values()) == tm.TINY.weight_count(vocab)


def test_the_large_size_has_a_gib_of_weights_in_a_shape_vllm_accepts() -> None:
    """Issue 36: the benchmarks' model carries at least 1 GiB of weight bytes (float32), with a
    head size the CPU attention accepts; the tiny one stays small for the tests."""
    large, tiny = tm.SHAPES["large"], tm.SHAPES["tiny"]
    assert large.weight_count(tm.VOCAB_SIZE) * 4 >= 2**30
    assert tiny.weight_count(tm.VOCAB_SIZE) * 4 < 4 * 2**20
    for shape in (large, tiny):
        assert shape.head_dim in tm.CPU_ATTENTION_HEAD_SIZES
        assert shape.head_dim * shape.heads == shape.hidden


def test_the_size_flag_builds_the_shape_it_names(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tm.Shape] = []

    def build(out: Path, seed: int, shape: tm.Shape) -> str:
        built.append(shape)
        return "sha256:x"

    monkeypatch.setattr(tm, "build", build)
    (tmp_path / "m").mkdir()
    assert tm.main(["--out", str(tmp_path / "m"), "--size", "large"]) == 0
    assert built == [tm.LARGE]
    with pytest.raises(SystemExit):
        tm.main(["--out", str(tmp_path / "m"), "--size", "huge"])
