"""`LossScaledFP16`: float16 autocast with a dynamic loss scale, for `trainer=cpu_fp16` / `trainer=gpu_fp16`.

Why not Lightning's own `precision="16-mixed"`: on CPU Lightning 2.6 silently runs bf16 instead, and its AMP
`optimizer_step` unscales the gradients only after the training step returns, while `PolicyModule` clips them
and logs their norm inside the step (manual optimisation), so it would clip and report the scaled gradient
(~2^16 too large). Here the module unscales first (`optim_step.checked_grad_norm` calls `unscale`), and this
plugin's step only steps and updates the scale: `GradScaler.step` skips an update whose gradient holds inf / NaN
(an fp16 overflow), and `update` halves the scale then; otherwise the scale grows every `growth_interval` steps.

Distributed runs skip alike: a rank's overflow check sees only its own gradients (a pipeline stage's layers, an FSDP
or distributed-optimizer shard), so `unscale` takes the maximum of the ranks' inf / NaN flags over the world
before the step reads them: one rank's overflow skips the update, and halves the scale, on every rank.
"""

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision


class LossScaledFP16(MixedPrecision):
    def __init__(self, *, device: str = "cpu", init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        super().__init__("16-mixed", device, torch.amp.GradScaler(device, init_scale=init_scale,
                                                                  growth_interval=growth_interval))

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the accumulated gradients by the loss scale, in place (once per optimizer step)."""
        # A pipeline stage before the last never scales a loss (megatron's schedule scales it on the last stage):
        # scaling a zero creates the scale there, as GradScaler does on its first `scale`.
        self.scaler.scale(torch.zeros((), device=self.device))
        self.scaler.unscale_(optimizer)
        if self.scaler.is_enabled() and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._agree_on_overflow(optimizer)

    def _agree_on_overflow(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank's inf / NaN flags become the world's maximum (a collective: every rank unscales each step).
        GradScaler keeps them per device in its per-optimizer state, which `step` and `update` read."""
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flag = torch.zeros((), dtype=torch.float32, device=self.scaler._scale.device)
        for value in found.values():
            flag = torch.maximum(flag, value.to(flag.device, torch.float32))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not found:  # no gradient on this rank: the step still needs a flag to read
            found[flag.device] = flag.clone()
        for value in found.values():
            value.copy_(flag)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        closure()  # manual optimisation: the backward passes ran in the training step already
        step_output = self.scaler.step(optimizer, **kwargs)  # None when skipped (inf / NaN gradient)
        self.scaler.update()
        return step_output
