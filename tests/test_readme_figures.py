"""The README's figures of its main command are the ones the command prints (scripts/readme_figures.py): a change
that moves them fails here until `scripts/readme_figures.py --write` regenerates them."""

import runpy

import pytest
from helpers import ROOT

SCRIPT = runpy.run_path(str(ROOT / "scripts" / "readme_figures.py"))


@pytest.mark.subprocess
def test_the_readme_quotes_the_figures_its_main_command_prints(tmp_path):
    summary = SCRIPT["run_default"](tmp_path / "run")
    assert summary["steps"] == 120
    assert SCRIPT["quoted"]((ROOT / "README.md").read_text()) == SCRIPT["figures"](summary)


def test_rewrite_replaces_only_the_figures():
    text = (ROOT / "README.md").read_text()
    values = {"reward_first": "0.111", "reward_last": "0.999", "masked": "1.23e-7", "masked_max": "4.56e-6",
              "unmasked": "0.321"}
    new = SCRIPT["rewrite"](text, values)
    assert SCRIPT["quoted"](new) == values
    assert SCRIPT["rewrite"](new, SCRIPT["quoted"](text)) == text  # nothing else moved


def test_a_phrase_missing_from_the_readme_is_named():
    with pytest.raises(ValueError, match="reward mean .* 0 times"):
        SCRIPT["quoted"]("no figures here")
