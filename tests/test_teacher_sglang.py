"""teacher=sglang against a real SGLang server (float32, on CPU) serving a tiny teacher: its log-probs of packed
samples equal the HF teacher's over the full vocabulary at temperature 1 (within the two engines' float32 gap,
1e-4), and an algo=opd run through it logs, at its first step (the same rollouts), the teacher figures of the same
run with the in-process teacher over the full vocabulary."""

import pytest
import torch
from helpers import column, compose_cfg, read_metrics
from sglang_checks import require_sglang
from test_module import make_samples, pack

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
require_sglang(module=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """(checkpoint dir, URL of an SGLang server serving it), launched the way a rollout=sglang run launches one."""
    from topp_rl.models import build_char_tokenizer, build_tiny_model, save_model
    from topp_rl.train import engine_for

    tmp = tmp_path_factory.mktemp("teacher-sglang")
    model, tokenizer = build_tiny_model(layers=3, seed=7, tokenizer=build_char_tokenizer()), build_char_tokenizer()
    path = save_model(model, tokenizer, tmp / "teacher")
    engine = engine_for(compose_cfg(tmp, "rollout=sglang"), model.float(), tokenizer, tmp)(0)
    try:
        yield path, engine.urls[0], model
    finally:
        engine.close()


def test_server_log_probs_equal_the_hf_teacher_over_the_full_vocabulary(teacher):
    from topp_rl.teacher import SGLangTeacher

    path, url, model = teacher
    samples = make_samples(model)
    batch = pack(samples, [0, 1, 2, 3], advantages=torch.zeros(6))
    got = SGLangTeacher(url=url, path=str(path)).logprobs(batch)
    ref = []
    for prompt, response, _ in samples[:4]:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
        ref.append(torch.log_softmax(logits, -1)[torch.arange(len(response)), response])
    torch.testing.assert_close(got.double(), torch.cat(ref), rtol=0, atol=TOL)


def test_opd_through_the_server_logs_the_in_process_teachers_figures(tmp_path, teacher):
    from topp_rl.train import train

    path, url, _ = teacher
    common = ["logger=csv", "algo=opd", "rollout.n_samples=1", "rollout.temperature=1.0"]
    train(compose_cfg(tmp_path / "sglang", *common, "teacher=sglang", f"teacher.url={url}", f"teacher.path={path}"))
    train(compose_cfg(tmp_path / "hf", *common, "teacher=hf_path", f"teacher.path={path}",
                      "teacher.use_candidate_mask=false"))
    remote, local = read_metrics(tmp_path / "sglang"), read_metrics(tmp_path / "hf")
    for key in ("train/teacher_kl", "train/teacher_logprob_mean"):
        assert len(column(remote, key)) == 2
        assert abs(column(remote, key)[0] - column(local, key)[0]) <= TOL, key
