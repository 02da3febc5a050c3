"""The distillation teacher: its pass equals dense per-sample log-probs (kept set and full vocabulary), it is
frozen and leaves the policy's gradients alone, a teacher equal to the policy gives zero KL and gradient, runs of
algo=opd and GRPO + teacher KL log the teacher figures, and bad teacher settings are refused at start."""

import copy
import json

import pytest
import torch
from helpers import column, compose_cfg, read_metrics
from test_module import TEMP, make_samples, pack

from topp_rl.config import validate_config
from topp_rl.losses import GRPOLoss, OPDLoss
from topp_rl.models import build_char_tokenizer, build_tiny_model, save_model
from topp_rl.teacher import HFTeacher, check_same_tokenizer
from topp_rl.teacher.hf import output_rows
from topp_rl.trainer.backbone import HFBackbone
from topp_rl.trainer.hook import ToppLogProb
from topp_rl.trainer.module import PolicyModule
from topp_rl.trainer.timer import PhaseTimer

SIZES = {"hidden": 32, "heads": 4, "kv_heads": 2}


def tiny(*, seed: int, layers: int = 2, vocab_size: int = 96):
    return build_tiny_model(vocab_size=vocab_size, layers=layers, seed=seed, tokenizer=build_char_tokenizer(), **SIZES)


@pytest.fixture(scope="module")
def policy():
    return tiny(seed=3)


def _module(policy, teacher, loss, *, teacher_use_mask=False) -> PolicyModule:
    return PolicyModule(policy=HFBackbone(policy), loss=loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        hook=ToppLogProb(use_mask=True, temperature=TEMP), teacher=HFBackbone(teacher),
                        teacher_use_mask=teacher_use_mask)


def dense_teacher_logprobs(teacher, samples, index, *, masked: bool) -> torch.Tensor:
    """Per sample, log_softmax(logits / T) at each response token, over its kept set (rows without one: the
    whole vocabulary) or the whole vocabulary; float64."""
    out = []
    for i in index:
        prompt, response, rows = samples[i]
        with torch.no_grad():
            logits = teacher(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double() / TEMP
        for z, token, row in zip(logits, response, rows, strict=True):
            if masked and row:
                keep = torch.zeros_like(z, dtype=torch.bool)
                keep[row] = True
                z = z.masked_fill(~keep, float("-inf"))
            out.append(torch.log_softmax(z, -1)[token])
    return torch.stack(out)


@pytest.mark.parametrize("masked", [True, False], ids=["kept-set", "full-vocab"])
def test_teacher_pass_equals_dense_log_probs_and_leaves_the_policy_alone(policy, masked):
    teacher = tiny(seed=11, layers=3)
    samples = make_samples(policy)
    micro = [pack(samples, [0, 1, 2], advantages=torch.zeros(6)), pack(samples, [3, 4, 5], advantages=torch.zeros(6))]
    module = _module(policy, teacher, GRPOLoss(), teacher_use_mask=masked)
    got = module.teacher_pass(micro)
    for lp, index in zip(got, ([0, 1, 2], [3, 4, 5]), strict=True):
        ref = dense_teacher_logprobs(teacher, samples, index, masked=masked)
        torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
        assert not lp.requires_grad
    assert not any(p.requires_grad for p in module.teacher.parameters())
    assert all(p.grad is None for p in module.policy.parameters())


def test_teacher_equal_to_the_policy_gives_zero_kl_and_no_gradient(policy):
    samples = make_samples(policy)
    micro = [pack(samples, list(range(6)), advantages=torch.zeros(6))]
    module = _module(policy, copy.deepcopy(policy), OPDLoss(), teacher_use_mask=True)
    old = [module.onpolicy_pass(mb)[0] for mb in micro]
    metrics, _ = module.accumulate_gradients(micro, [None], old=old, timer=PhaseTimer(),
                                             teachers=module.teacher_pass(micro))
    kl_sum, n = metrics["train/teacher_kl"]
    assert n > 0 and abs(kl_sum / n) < 1e-6
    assert max(float(p.grad.abs().max()) for p in module.policy.parameters() if p.grad is not None) < 1e-6


def test_a_different_teacher_gives_the_opd_gradient_of_its_kl(policy):
    """OPD's gradient is nonzero with a different teacher, and equals GRPO's with the advantage -(old - teacher)."""
    samples = make_samples(policy)
    teacher = tiny(seed=11, layers=3)
    opd = _module(policy, teacher, OPDLoss())
    micro = [pack(samples, list(range(6)), advantages=torch.zeros(6))]
    teachers = opd.teacher_pass(micro)
    old = [opd.onpolicy_pass(mb)[0] for mb in micro]
    metrics, _ = opd.accumulate_gradients(micro, [None], old=old, timer=PhaseTimer(), teachers=teachers)
    grads = [p.grad.clone() for p in opd.policy.parameters()]
    assert metrics["train/teacher_kl"][0] != 0

    plain = PolicyModule(policy=HFBackbone(copy.deepcopy(policy)), loss=GRPOLoss(),
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1), hook=ToppLogProb(use_mask=True, temperature=TEMP))
    shaped = [pack(samples, list(range(6)), advantages=torch.zeros(6))]
    shaped[0] = type(shaped[0])(**{**shaped[0].__dict__, "advantages": (teachers[0] - old[0]).float()})
    plain.accumulate_gradients(shaped, [None], old=old, timer=PhaseTimer())
    for g, ref in zip(grads, (p.grad for p in plain.policy.parameters()), strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    model, tokenizer = tiny(seed=7, layers=3, vocab_size=128), build_char_tokenizer()
    return save_model(model, tokenizer, path)


@pytest.mark.parametrize("algo", [["algo=opd", "rollout.n_samples=1"], ["algo=grpo", "algo.teacher_kl_coeff=0.5"]],
                         ids=["opd", "grpo+teacher_kl"])
def test_train_with_a_teacher_logs_its_figures(tmp_path, teacher_dir, algo):
    from topp_rl.train import train

    cfg = compose_cfg(tmp_path, "logger=csv", *algo, "teacher=hf_path", f"teacher.path={teacher_dir}")
    summary = train(cfg)
    assert summary["steps"] == 2
    rows = read_metrics(tmp_path)
    kl, teacher_lp = column(rows, "train/teacher_kl"), column(rows, "train/teacher_logprob_mean")
    assert len(kl) == 2 and all(k != 0 for k in kl)
    assert len(teacher_lp) == 2 and all(lp < 0 for lp in teacher_lp)
    assert len(column(rows, "perf/teacher_s")) == 2


@pytest.mark.parametrize(("overrides", "match"), [
    (["algo=opd"], "algo=opd with algo.teacher_kl_coeff=1.0 needs a teacher, but teacher=none"),
    (["algo.teacher_kl_coeff=0.1"], "algo=grpo with algo.teacher_kl_coeff=0.1 needs a teacher, but teacher=none"),
    (["algo.teacher_kl_coeff=-1"], "algo.teacher_kl_coeff=-1.*>= 0"),
    (["+teacher.path=/x"], r"teacher.\* keys \['path'\] are set with teacher=none"),
    (["teacher=hf_path", "teacher.path=/x", "teacher.use_candidate_mask=true", "module.use_mask=false"],
     "teacher.use_candidate_mask=True.*module.use_mask=false"),
    (["teacher=sglang", "teacher.url=http://127.0.0.1:1", "teacher.path=/x", "teacher.use_candidate_mask=true"],
     "teacher.use_candidate_mask=True: must be false with teacher=sglang"),
    (["teacher=sglang", "teacher.url=http://127.0.0.1:1", "teacher.path=/x", "rollout.temperature=0.8"],
     "rollout.temperature=0.8: must be 1 with teacher=sglang"),
])
def test_bad_teacher_settings_are_refused_at_start(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_config(compose_cfg(tmp_path, *overrides))


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tmp_path, policy):
    other = tiny(seed=1, vocab_size=128)
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="teacher T has 128 vocabulary rows, the policy P 96"):
        check_same_tokenizer(policy=("P", output_rows(policy), tok), teacher=("T", output_rows(other), tok))
    # same rows, ids swapped in the teacher's tokenizer.json
    path = save_model(tiny(seed=1), tok, tmp_path / "swapped")
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[5:7]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=f"the teacher {path}'s tokenizer .* differs from the policy P's"):
        HFTeacher(path=str(path)).module_parts(policy=policy, tokenizer=tok, policy_name="P")


def test_a_checkpoint_from_before_the_teacher_resumes_without_one_and_refuses_one(tmp_path):
    """Older checkpoints record no teacher keys: they resume as the teacher-less runs they were; adding a teacher
    (or its KL) on resume is a change of guarded keys."""
    from omegaconf import OmegaConf

    from topp_rl.run.rundir import config_changes

    def record(*overrides):
        return OmegaConf.to_container(compose_cfg(tmp_path, *overrides), resolve=True)

    keys = list(record()["resume"]["guarded_keys"])
    old = record()
    del old["teacher"], old["algo"]["teacher_kl_coeff"], old["algo"]["loss"]["teacher_kl_coef"]
    assert config_changes(old, record(), keys) == []
    changed = config_changes(old, record("teacher=hf_path", "teacher.path=/t", "algo.teacher_kl_coeff=0.5"), keys)
    assert "algo.teacher_kl_coeff: 0.0 -> 0.5" in changed and "teacher.path: '<absent>' -> '/t'" in changed
