"""A vLLM worker extension (`--worker-extension-cls topp_rl_vllm_worker.WeightReload`), imported inside the vLLM
server's processes (its own venv; this folder is put on their PYTHONPATH, nothing else of topp_rl is).

`topp_rl_reload_weights` is vLLM's `reload_weights` from a checkpoint dir, then the refresh of a tied output head:
with tied embeddings the head's weight is the embedding's, but vLLM's in-place reload replaces the embedding's
parameter and, on CPU, the head's prepacked GEMM weight was made from the old one, so the head kept serving the OLD
weights. Re-tying it and re-running its `process_weights_after_loading` makes it use the new ones.

The broadcast route (`weight_sync=distributed`): `topp_rl_join_weight_group` makes this worker rank
`rank_offset + self.rank` of the trainer's group (the trainer is rank 0 and holds the store; the same construction
as SGLang's `init_custom_process_group`), `topp_rl_receive_bucket` receives one bucket's tensors in the trainer's
order, and `topp_rl_load_received` loads them all through the same in-place reload, then the head refresh.
"""

from datetime import timedelta


class WeightReload:
    def topp_rl_reload_weights(self, weights_path: str) -> bool:
        """Load every weight of the checkpoint at `weights_path` in place; True when a tied head was refreshed."""
        self.reload_weights(weights_path=weights_path)
        return self._topp_rl_retie_head()

    def topp_rl_join_weight_group(
        self, host: str, port: int, world_size: int, rank_offset: int, backend: str, group_name: str,
        timeout_s: float,
    ) -> int:  # fmt: skip
        """Join the trainer's weight-broadcast group; returns this worker's rank in it."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

        rank = rank_offset + self.rank
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), dist.PrefixStore(group_name, store), group_name=group_name,
            backend_options=None, timeout=timeout, device_id=None,
        )  # fmt: skip
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        self._topp_rl_group, self._topp_rl_received = group, []
        return rank

    def topp_rl_receive_bucket(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """Receive one bucket (a broadcast per tensor, in order) and keep it for `topp_rl_load_received`."""
        import torch
        import torch.distributed as dist

        device = next(self.model_runner.get_model().parameters()).device
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(tensor, src=0, group=self._topp_rl_group)
            self._topp_rl_received.append((name, tensor))
        return len(names)

    def topp_rl_load_received(self) -> bool:
        """Load every received tensor in place (vLLM's reload from an iterator); True when a tied head was
        refreshed."""
        weights, self._topp_rl_received = self._topp_rl_received, []
        self.reload_weights(weights_iterator=iter(weights))
        return self._topp_rl_retie_head()

    def topp_rl_leave_weight_group(self) -> None:
        import torch.distributed as dist

        group = getattr(self, "_topp_rl_group", None)
        if group is not None:
            self._topp_rl_group = None
            dist.destroy_process_group(group)

    def _topp_rl_retie_head(self) -> bool:
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        head, body = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(body, "embed_tokens", None)
        if not (getattr(config, "tie_word_embeddings", False) and head is not None and embed is not None):
            return False
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
        return True
