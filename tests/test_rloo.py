"""`algo=rloo`: leave-one-out advantages by hand through the datamodule the config builds (real EmbeddedEngine, tiny
model), the REINFORCE loss on the sequence log-likelihood it selects, and a short train.py run."""

import torch
from helpers import compose_cfg, metric_columns
from hydra.utils import instantiate

from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.losses import LossInputs
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.rollout import SamplingParams
from topp_rl.rollout.advantages import RLOOAdvantage
from topp_rl.tasks import CopyDigitTask
from topp_rl.train import train

TOK = build_char_tokenizer()


class _LengthTask(CopyDigitTask):
    """Reward = response length in characters (varies under a random model)."""

    def reward(self, response, record):
        return float(len(response))


def test_rloo_advantages_are_leave_one_out_by_hand(tmp_path):
    cfg = compose_cfg(tmp_path, "algo=rloo", "rollout.n_samples=4", "rollout.prompts_per_step=3")
    model = build_tiny_model(tokenizer=TOK, seed=0, initializer_range=0.2)
    engine = EmbeddedEngine(model, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id, progress=False)
    params = SamplingParams(top_p=0.9, max_new_tokens=4, n=4, stop_token_ids=tuple(range(3, 30)))
    dm = instantiate(cfg.data, _partial_=True)(engine=engine, task=_LengthTask(), tokenizer=TOK, params=params)
    assert isinstance(dm.advantage, RLOOAdvantage) and not dm.advantage.normalize_std
    batch = dm.rollout(dm.ticket(0))
    rewards = [s.reward for s in batch.samples]
    assert len(set(rewards)) > 1  # the premise: rewards that differ
    by_hand = []
    for i, s in enumerate(batch.samples):
        others = [r for j, r in enumerate(rewards) if j != i and batch.samples[j].group_index == s.group_index]
        by_hand.append(s.reward - sum(others) / len(others))
    adv = torch.cat([mb.advantages[torch.cumsum(mb.response_lengths, 0) - 1] for mb in batch.micro_batches])
    torch.testing.assert_close(adv, torch.tensor(by_hand))


def test_rloo_loss_is_reinforce_on_the_sequence_log_likelihood(tmp_path):
    loss_fn = instantiate(compose_cfg(tmp_path, "algo=rloo").algo.loss)
    # Two samples of 2 and 3 tokens, advantages 1.5 and -0.5, on-policy (ratio 1).
    logprobs = torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.5, 1.5, -0.5, -0.5, -0.5], dtype=torch.float64)
    inputs = LossInputs(logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=adv,
                        loss_mask=torch.ones(5, dtype=torch.float64), seq_index=torch.tensor([0, 0, 1, 1, 1]),
                        num_loss_tokens_global=5.0, num_sequences_global=2)
    loss, _ = loss_fn(inputs)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # -(1/G) sum_s A_s sum_{t in s} log pi_t: the gradient per token is -A_s / G, the value -(1.5 * 2 - 0.5 * 3) / 2.
    torch.testing.assert_close(grad, -adv / 2)
    torch.testing.assert_close(loss.detach(), torch.tensor(-(1.5 * 2 - 0.5 * 3) / 2, dtype=torch.float64))
    assert (loss_fn.eps_clip, loss_fn.eps_clip_high) == (0.2, 0.2)


def test_rloo_normalize_std_divides_by_the_group_std():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    got = RLOOAdvantage(normalize_std=True, eps=0.0)(r, g)
    std0 = (((1 - 1 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2) ** 0.5
    torch.testing.assert_close(got, torch.tensor([(1 - 0) / std0, (0 - 0.5) / std0, (0 - 0.5) / std0, 0.0, 0.0]))


def test_algo_rloo_trains(tmp_path):
    summary = train(compose_cfg(tmp_path, "algo=rloo", "logger=csv"))
    assert summary["steps"] == 2
    assert len(metric_columns(tmp_path)["train/loss"]) == 2
