"""A vLLM worker extension (`--worker-extension-cls topp_rl_vllm_worker.WeightReload`), imported inside the vLLM
server's processes (its own venv; this folder is put on their PYTHONPATH, nothing else of topp_rl is).

`topp_rl_reload_weights` is vLLM's `reload_weights` from a checkpoint dir, then the refresh of a tied output head:
with tied embeddings the head's weight is the embedding's, but vLLM's in-place reload replaces the embedding's
parameter and, on CPU, the head's prepacked GEMM weight was made from the old one, so the head kept serving the OLD
weights. Re-tying it and re-running its `process_weights_after_loading` makes it use the new ones.
"""


class WeightReload:
    def topp_rl_reload_weights(self, weights_path: str) -> bool:
        """Load every weight of the checkpoint at `weights_path` in place; True when a tied head was refreshed."""
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        head, body = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(body, "embed_tokens", None)
        if not (getattr(config, "tie_word_embeddings", False) and head is not None and embed is not None):
            return False
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
        return True
