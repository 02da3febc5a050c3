"""The trainer: `PolicyModule` (the LightningModule), the `Backbone` protocol and its HF adapter, the scorer
(`ToppLogProb`), LoRA, precision, the lr schedule, and a step's metrics (sums and counts, one owner per step).
Imports ops, data, models, parallel and losses; never the run room (run dir, checkpoints, export, console)."""
