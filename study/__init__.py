"""Issue 13's measurements: what the keep-sampling mask changes, on a real model (`python -m study`).

- `ratios`: one batch sampled at each setting of a grid (top-p, top-k, min-p x temperature), scored by the
  trainer's own scoring path (`PolicyModule.score`) on the rollout's weights with the mask and without; a table
  of importance ratios, k3 KL, kept-set sizes and kept mass per engine and setting, and a plot.
"""
