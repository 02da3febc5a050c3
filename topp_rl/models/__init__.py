"""Models and tokenizers that need no hub download (`builders`), and the HF MoE router hooks that record and
replay routes (`moe`), shared by the rollout engines and the trainer."""

from topp_rl.models.builders import (
    CHARS,
    FAMILIES,
    build_char_tokenizer,
    build_tiny,
    build_tiny_model,
    load_hf,
    load_smollm2,
    resolve_model_dir,
    save_model,
    smollm2_gguf_path,
)

__all__ = ["CHARS", "FAMILIES", "build_char_tokenizer", "build_tiny", "build_tiny_model", "load_hf", "load_smollm2",
           "resolve_model_dir", "save_model", "smollm2_gguf_path"]
