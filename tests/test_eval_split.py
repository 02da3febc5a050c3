"""`eval.split`: a run evaluates the training task's own held-out split (a saved DatasetDict's test split, a slice
of a data file, a generated task's test indices), prints one line per evaluation and puts the last one in
summary.json; splits that share rows with training, or that a task lacks, are refused at start. Also the start-up
check for `chat_template=true` without a template, and the end-of-run lines naming only what the run wrote."""

import json

import datasets
import pytest
from helpers import column, compose_cfg, read_metrics

from topp_rl.models import build_char_tokenizer, build_tiny_model, save_model
from topp_rl.run.commands import report_command
from topp_rl.run.summary import summary_lines
from topp_rl.train import build_run, train

# 1.0 for a row of the held-out rows, 0.0 for a training row: val/accuracy is 1 exactly when every evaluated prompt
# is held out, and the training reward 0 when training never reads one.
REWARD = "def held_out(response, record):\n    return 1.0 if record.data['part'] == 'held' else 0.0\n"
EVAL = ["eval.every_n_steps=2", "eval.num_prompts=32", "eval.k=2", "trainer.max_steps=2"]


def _rows(part: str, n: int) -> list[dict]:
    return [{"prompt": f"{i % 10}:", "answer": str(i % 10), "part": part} for i in range(n)]


def _dataset_cfg(tmp_path, path, *overrides: str):
    (tmp_path / "reward.py").write_text(REWARD)
    return compose_cfg(tmp_path / "run", "task=dataset", f"task.path={path}",
                       f"task.reward_fn={tmp_path}/reward.py:held_out", f"task.cache_dir={tmp_path}/cache", *overrides)


def test_eval_split_test_evaluates_the_saved_test_split(tmp_path, capsys):
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows("train", 8)),
                          "test": datasets.Dataset.from_list(_rows("held", 3))}).save_to_disk(str(saved))
    summary = train(_dataset_cfg(tmp_path, saved, "eval.split=test", "logger=csv", *EVAL))
    run = tmp_path / "run"
    rows = read_metrics(run)
    assert column(rows, "val/accuracy") == [1.0, 1.0]  # steps 0 and 2: only test rows were evaluated
    assert column(rows, "rollout/reward_mean") == [0.0, 0.0]  # and training read none of them
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["eval_set"] == f"{saved} [test]" and on_disk["eval_prompts"] == 3  # all 3 rows, not 32
    assert on_disk["eval_step"] == 2 and on_disk["val/accuracy"] == 1.0 and on_disk["val/pass@k"] == 1.0
    assert on_disk["best_step"] == 0 and on_disk["best_checkpoint"] == str(run / "checkpoints" / "best.ckpt")
    assert summary["val/mean@k"] == 1.0
    out = capsys.readouterr().out
    for step in (0, 2):
        assert f"[topp_rl] eval at step {step} ({saved} [test], 3 prompts): accuracy 1, response length " in out
    assert f"  best val/accuracy: 1 at step 0: {run}/checkpoints/best.ckpt\n" in out
    assert f"  in the run dir: summary.json, csv/ (metrics.csv)\n  plots: {report_command()} {run}\n" in out


def test_eval_split_takes_a_slice_of_a_data_file(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows("train", 6) + _rows("held", 2)))
    summary = train(_dataset_cfg(tmp_path, data, "task.split='train[:6]'", "eval.split='train[6:]'", "logger=none",
                                 *EVAL))
    assert summary["val/accuracy"] == 1.0 and summary["eval_prompts"] == 2
    assert summary["eval_set"] == f"{data} [train[6:]]"


@pytest.mark.parametrize(("overrides", "message"), [
    (["eval.split=test"],  # a file is one split: `test` names the same rows as `train`
     "eval.split='test' reads 8 of the rows task.split='train' trains on in {data} (a one-split source: every split "
     "name reads all its rows); hold rows out with slices of it, e.g. task.split='train[:90%]' "
     "eval.split='train[90%:]', or set eval.task to a task on a separate test file"),
    (["task.split='train[:6]'", "eval.split='train[4:]'"],
     "eval.split='train[4:]' reads 2 of the rows task.split='train[:6]' trains on in {data}"),
    (["eval.split=test", "eval.task='${task}'"],
     "eval.split='test' and eval.task (DatasetTask) are both set; set eval.split to evaluate the training task on "
     "another split, or eval.task for another task, not both"),
])
def test_an_eval_split_sharing_rows_with_training_is_refused_at_start(tmp_path, overrides, message):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows("train", 8)))
    with pytest.raises(ValueError) as info:
        train(_dataset_cfg(tmp_path, data, *overrides, "eval.every_n_steps=1", "logger=none"))
    assert str(info.value).startswith(message.format(data=data))


def test_a_split_the_saved_dataset_lacks_names_its_splits(tmp_path):
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows("train", 4))}).save_to_disk(str(saved))
    with pytest.raises(ValueError, match=rf"^eval.split='test' is not a split of {saved} \(splits: train \(4 rows\)\); "
                                         r"set eval.split to one of them or a slice of one"):
        train(_dataset_cfg(tmp_path, saved, "eval.split=test", "eval.every_n_steps=1", "logger=none"))


def test_a_generated_task_has_one_held_out_split_test(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^eval.split='train': the task ArithmeticTask generates its examples, and "
                                         r"its one held-out split is 'test'"):
        train(compose_cfg(tmp_path / "a", "task=arithmetic", "eval.split=train", "eval.every_n_steps=1"))
    summary = train(compose_cfg(tmp_path / "b", "task=arithmetic", "eval.split=test", "logger=none", *EVAL))
    assert summary["eval_set"] == "ArithmeticTask test (indices from 10**9)" and summary["eval_prompts"] == 32
    out = capsys.readouterr().out
    assert "[topp_rl] eval at step 2 (ArithmeticTask test (indices from 10**9), 32 prompts): accuracy " in out
    # logger=none: no csv/, so neither it nor the report command is named; the HF export and best.ckpt are
    assert "csv/" not in out and "topp_rl.report" not in out
    assert "  in the run dir: summary.json\n" in out
    assert f"  HF checkpoint: {tmp_path / 'b' / 'hf'} (step 2; " in out


def test_chat_template_without_a_template_fails_at_start_naming_the_model(tmp_path):
    model_dir = save_model(build_tiny_model(tokenizer=build_char_tokenizer()), build_char_tokenizer(),
                           tmp_path / "model")
    cfg = compose_cfg(tmp_path / "run", "model=hf_path", f"model.path={model_dir}", "task=arithmetic",
                      "task.chat_template=true")
    with pytest.raises(ValueError) as info:
        build_run(cfg)
    assert str(info.value) == (
        f"task.chat_template=true, but the tokenizer of {model_dir} has no chat template; set "
        "task.chat_template=false to encode prompts as plain text, or use a model whose tokenizer has a chat "
        "template (e.g. model=smollm2, or model=hf_path model.path=<an instruct model's dir>)"
    )


def test_summary_lines_name_only_what_exists(tmp_path):
    summary = {"steps": 3, "wall_s": 2.0, "hf_export": str(tmp_path / "hf"), "hf_export_step": 3}
    assert summary_lines(summary, str(tmp_path)) == [f"[topp_rl] run finished: 3 steps in 2 s; run dir: {tmp_path}"]
    for name in ("hf", "csv", "wandb"):
        (tmp_path / name).mkdir()
    (tmp_path / "summary.json").write_text("{}")
    assert summary_lines(summary, str(tmp_path))[1:] == [
        f"  HF checkpoint: {tmp_path}/hf (step 3; loads with transformers' from_pretrained)",
        "  in the run dir: summary.json, csv/ (metrics.csv), wandb/ (W&B)",
        f"  plots: {report_command()} {tmp_path}",
    ]
