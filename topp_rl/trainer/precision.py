"""`LossScaledFP16`: float16 autocast with a dynamic loss scale, for `trainer=cpu_fp16` / `trainer=gpu_fp16`.

Why not Lightning's own `precision="16-mixed"`: on CPU Lightning 2.6 silently runs bf16 instead, and its AMP
`optimizer_step` unscales the gradients only after the training step returns, while `PolicyModule` clips them
and logs their norm inside the step (manual optimisation), so it would clip and report the scaled gradient
(~2^16 too large). Here the module unscales first (`optim_step.checked_grad_norm` calls `unscale`), and this
plugin's step only steps and updates the scale: `GradScaler.step` skips an update whose gradient holds inf / NaN
(an fp16 overflow), and `update` halves the scale then; otherwise the scale grows every `growth_interval` steps.
"""

import torch
from lightning.pytorch.plugins.precision import MixedPrecision


class LossScaledFP16(MixedPrecision):
    def __init__(self, *, device: str = "cpu", init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        super().__init__("16-mixed", device, torch.amp.GradScaler(device, init_scale=init_scale,
                                                                  growth_interval=growth_interval))

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the accumulated gradients by the loss scale, in place (once per optimizer step)."""
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        closure()  # manual optimisation: the backward passes ran in the training step already
        step_output = self.scaler.step(optimizer, **kwargs)  # None when skipped (inf / NaN gradient)
        self.scaler.update()
        return step_output
