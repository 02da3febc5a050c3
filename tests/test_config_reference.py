"""docs/config.md, the config reference, is generated from the comments in conf/: every key of every group option
has one, the page is what the generator writes now, and `--help` prints the same text for the keys it lists."""

import re
import shutil

import pytest
from helpers import ROOT
from hydra import compose, initialize_config_dir

from topp_rl import config_reference as ref

CACHED = (ref.options, ref.default_options, ref._composed, ref._help_docs)


@pytest.fixture
def fresh_caches():
    for fn in CACHED:
        fn.cache_clear()
    yield
    for fn in CACHED:
        fn.cache_clear()


@pytest.fixture(scope="module")
def page() -> str:
    return ref.render()


def test_every_key_of_every_group_option_has_a_comment():
    missing = ref.missing_comments()
    assert not missing, "keys without a comment in conf/ (a trailing # comment or the lines above the key):\n" + (
        "\n".join(missing))


def test_docs_config_md_is_what_the_generator_writes(page):
    assert (ROOT / "docs" / "config.md").read_text() == page, (
        "docs/config.md is stale: run python -m topp_rl.config_reference")
    rows = dict(re.findall(r"^\| `([^`]+)` \|(.*)$", page, flags=re.M))  # key -> the rest of its row
    assert rows["algo.loss.kl_coef"].endswith("| weight of KL(pi \\|\\| pi_ref) in the loss (REINFORCE++: in the "
                                              "reward); 0: off, no reference pass |")
    assert rows["module.ppo_epochs"].startswith(" `1` | optimizer steps per rollout step")
    assert rows["data.seed"] == " `${seed}` | follows `seed` |"
    for key in ("algo.loss.eps_clip_high", "algo.advantage.normalize_std", "rollout.engine.timeouts.connect_s",
                "rollout.step.env_timeout_s", "parallel.cp_mode", "eval.k", "hydra.run.dir", "task.num_keys"):
        assert key in rows


def test_a_key_without_a_comment_is_named_with_its_option(tmp_path, monkeypatch, fresh_caches):
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    grpo = conf / "algo" / "grpo.yaml"
    text = grpo.read_text()
    assert "  kl_coef: 0.0  # " in text
    grpo.write_text(re.sub(r"(?m)^  kl_coef: 0\.0  #.*$", "  kl_coef: 0.0", text))
    monkeypatch.setattr(ref, "config_dir", lambda: conf)
    missing = ref.missing_comments()
    assert "algo.loss.kl_coef (algo=grpo)" in missing
    assert "algo.loss.kl_coef (algo=cispo)" in missing  # no option of the group has a comment to lend
    assert not [m for m in missing if not m.startswith("algo.loss.kl_coef ")]


def test_comments_are_read_trailing_above_and_from_a_base_option():
    docs = {key.path: key.doc for option in ref.options()["algo"] if option.name == "cispo"
            for key in option.keys.values()}
    assert docs["algo.loss.eps_clip"] == "lower clip of the ratio pi / pi_old: 1 - eps_clip"  # grpo's, its base
    top = {key.path: key.doc for key in ref.options()[""][0].keys.values()}
    assert top["data.drop_zero_variance_groups"].startswith("true: leave out the prompt groups")  # the line above
    assert top["seed"] == "seeds the model init, the task and the sampler"  # trailing


def test_an_option_of_another_group_sets_values_instead_of_defining_keys(page):
    lookup = next(o for o in ref.options()["task"] if o.name == "lookup")
    assert "rollout.top_p" in lookup.sets and "rollout.top_p" not in lookup.keys
    assert "task.num_keys" in lookup.keys
    assert "Sets `rollout/step=agent`, `rollout.top_p=0.9`" in page


def test_help_prints_each_listed_key_with_its_comment_and_the_composed_value(page):
    ref.register_help_resolver()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3", job_name="train"):
        cfg = compose("config", overrides=["rollout.top_p=0.9", "task=dataset"], return_hydra_config=True)
    template = cfg.hydra.help.template
    listed = re.findall(r"\$\{topp_rl\.key_help:([\w.]+)\}", (ROOT / "conf/hydra/help/topp_rl.yaml").read_text())
    assert len(listed) >= 15
    flat = " ".join(template.split())
    for key in listed:
        doc = " ".join(ref._help_docs()[key][0].split())
        assert f"{key} [" in flat or f"{key} (" in flat
        assert doc in flat, key
        assert re.search(rf"^\| `{re.escape(key)}` \|.*\| {re.escape(ref._cell(doc))} \|$", page, flags=re.M), key
    assert "rollout.top_p [0.9]  nucleus mass the sampler keeps (1.0: no top-p)" in template
    assert "task.path [???]  the data:" in template  # task=dataset: the key is there, and must be set
    assert "model.path (model=hf_path)  a checkpoint directory" in template  # model=tiny has no model.path
