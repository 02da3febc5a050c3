"""The README's figures of its main command are the ones the command prints on this machine's CPU kind
(scripts/readme_figures.py): a change that moves them fails here until `scripts/readme_figures.py --write`
regenerates them, on each CPU kind the README quotes."""

import runpy

import pytest
from helpers import ROOT

SCRIPT = runpy.run_path(str(ROOT / "scripts" / "readme_figures.py"))


@pytest.mark.subprocess
def test_the_readme_quotes_the_figures_its_main_command_prints(tmp_path):
    name = SCRIPT["cpu_name"]()
    kind = SCRIPT["cpu_kind"](name)
    if kind is None:  # never on CI's machines (an Intel Xeon or an AMD EPYC)
        pytest.skip(f"the README quotes the figures of {', '.join(SCRIPT['PHRASES'])} CPUs; this one ({name}) "
                    "rounds its own way")
    summary = SCRIPT["run_default"](tmp_path / "run")
    assert summary["steps"] == 120
    assert SCRIPT["quoted"]((ROOT / "README.md").read_text(), kind) == SCRIPT["figures"](summary), name


@pytest.mark.parametrize("kind", ["Intel(R) Xeon(R)", "AMD EPYC"])
def test_rewrite_replaces_only_the_figures_of_one_cpu_kind(kind):
    text = (ROOT / "README.md").read_text()
    values = {"reward_first": "0.111", "reward_last": "0.999", "masked": "1.23e-7", "masked_max": "4.56e-6",
              "unmasked": "0.321"}
    new = SCRIPT["rewrite"](text, values, kind)
    assert SCRIPT["quoted"](new, kind) == values
    other = next(k for k in SCRIPT["PHRASES"] if k != kind)
    assert SCRIPT["quoted"](new, other) == SCRIPT["quoted"](text, other)  # the other kind's figures stay
    assert SCRIPT["rewrite"](new, SCRIPT["quoted"](text, kind), kind) == text  # nothing else moved


def test_cpu_kinds_are_recognised_by_their_model_names():
    assert SCRIPT["cpu_kind"]("Intel(R) Xeon(R) Processor") == "Intel(R) Xeon(R)"
    assert SCRIPT["cpu_kind"]("AMD EPYC 9B14") == "AMD EPYC"
    assert SCRIPT["cpu_kind"]("Apple M2") is None


def test_a_phrase_missing_from_the_readme_is_named():
    with pytest.raises(ValueError, match="reward mean .* 0 times"):
        SCRIPT["quoted"]("no figures here", "Intel(R) Xeon(R)")
