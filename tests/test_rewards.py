"""Rewards: math-verify answers and the Countdown rule on concrete strings, weighted named reward sets (float,
dict and batched functions, import and file paths) and their error messages."""

import textwrap

import pytest

from topp_rl.data import PromptRecord
from topp_rl.tasks.rewards import (
    RewardError,
    RewardSet,
    countdown_expression,
    countdown_score,
    leading_number,
    math_answer,
    resolve_reward_fn,
)

GSM8K_ANSWER = "Sam has 12 - 5 = <<12-5=7>>7 apples, then 7 + 8 = <<7+8=15>>15.\n#### 15"


def _record(answer: str | None, **data) -> PromptRecord:
    return PromptRecord(index=0, text="q", prompt_ids=[1], answer=answer, data=data)


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        (r"So he has $\boxed{15}$ apples.", 1.0),
        ("12 - 5 = 7, 7 + 8 = 15\n#### 15", 1.0),
        ("The answer is 15.", 1.0),
        ("The answer is 15.0", 1.0),
        ("The answer is 16.", 0.0),
        ("He had 15 apples at noon, so the answer is 16.", 0.0),  # the last number counts
        ("15 first, but #### 16", 0.0),  # the GSM8K marker wins over earlier numbers
        (r"\boxed{16} though 15 is close", 0.0),  # so does a boxed answer
        ("####", 0.0),
        ("I do not know.", 0.0),
        ("", 0.0),
    ],
)
def test_math_answer_gsm8k(response, reward):
    assert math_answer(response, _record(GSM8K_ANSWER)) == reward


def test_math_answer_symbolic_and_formatted_references():
    assert math_answer(r"\boxed{0.5}", _record(r"\frac{1}{2}")) == 1.0
    assert math_answer(r"\boxed{\frac{2}{4}}", _record("0.5")) == 1.0
    assert math_answer(r"\boxed{1+x^2}", _record("x^2+1")) == 1.0  # bare LaTeX reference
    assert math_answer("It makes 7,500 toys.", _record("#### 7500")) == 1.0
    assert math_answer("It makes 7,501 toys.", _record("#### 7500")) == 0.0
    assert math_answer("It was -5 degrees.", _record("18 - 23 = -5\n#### -5")) == 1.0
    with pytest.raises(ValueError, match=r"cannot parse the reference answer 'no number here'"):
        math_answer("1", _record("no number here"))
    with pytest.raises(ValueError, match="set the task's answer_key"):
        math_answer("1", _record(None))


@pytest.mark.parametrize(
    ("response", "use_all", "expected"),
    [
        ("25+3*7", True, 1.0),  # 46
        ("3*7+25 = 46", True, 1.0),  # a trailing "= value" is ignored
        ("thinking...<answer>(7*3)+25</answer>", True, 1.0),
        ("<answer>1</answer> no wait <answer>25+7*3</answer>", True, 1.0),  # the last answer tag
        ("25/5*...", True, 0.0),  # `...` is no number
        ("25+21", True, 0.0),  # 21 was not given
        ("25+3*7+3", True, 0.0),  # 3 used twice
        ("(25-7)*3", True, 0.5),  # 54: well formed, wrong value: format credit
        ("25/(7-7)*3", True, 0.0),  # 7 used twice
        ("25*7/(3*0)", True, 0.0),  # 0 was not given
        ("25+3*7.0", True, 0.0),  # floats are not allowed
        ("25+-3*-7", True, 0.0),  # neither is unary minus
        ("25+3**7", True, 0.0),  # nor powers
        ("__import__('os').getcwd()", True, 0.0),  # nor anything else: ast, never eval
        ("25+3", True, 0.0),  # 7 unused: not allowed when every number must be used
        ("25+3", False, 0.5),  # allowed at most once, but 28 != 46
        ("25+7*3", False, 1.0),
        ("", True, 0.0),
    ],
)
def test_countdown_score(response, use_all, expected):
    assert countdown_score(response, [3, 7, 25], 46, use_all=use_all, format_credit=0.5) == expected


def test_countdown_exact_fractions_and_zero_division():
    assert countdown_score("(1+1/3)*3", [1, 1, 3, 3], 4) == 1.0  # exact: 4/3 * 3 == 4, no float rounding
    assert countdown_score("8/(3-8/3)", [8, 3, 8, 3], 24) == 1.0
    assert countdown_score("3/(3-3)", [3, 3, 3], 1, format_credit=0.25) == 0.25  # well formed, no value
    assert countdown_expression("  \n 1+2 = 3\n4+5") == "1+2"


def test_reward_set_weights_names_dicts_and_batches(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        textwrap.dedent(
            """
            from topp_rl.tasks.rewards import batched

            def length(response, record):  # verl's form: only the score is the reward
                return {"score": len(response) / 10, "has_digit": any(c.isdigit() for c in response)}

            @batched
            def longest(responses, records):
                top = max(len(r) for r in responses)
                return [float(len(r) == top) for r in responses]

            def scaled(response, record, *, scale):
                return scale * len(response)

            @batched
            def scaled_batch(responses, records, *, scale):
                return [scale for _ in responses]
            """
        )
    )
    rewards = RewardSet.from_config(
        [
            {"fn": "topp_rl.tasks.rewards:math_answer", "weight": 2.0, "name": "correct"},
            {"fn": f"{reward_file}:length", "weight": 0.5},
            {"fn": f"{reward_file}:longest", "weight": -1.0},
            {"fn": f"{reward_file}:scaled", "kwargs": {"scale": 0.01}, "batched": False},
            {"fn": f"{reward_file}:scaled_batch", "kwargs": {"scale": 3.0}, "weight": 0.0, "name": "zero"},
            # a dict entry summed because the entry declares it as a weighted term (the score weighs 0 here)
            {"fn": f"{reward_file}:length", "weight": 0.0, "name": "digits", "terms": {"has_digit": 2.0}},
        ]
    )
    assert [t.name for t in rewards.terms] == ["correct", "length", "longest", "scaled", "zero", "digits"]
    assert [t.batched for t in rewards.terms] == [False, False, True, False, True, False]  # the mark survives kwargs
    record = _record("#### 15")
    totals, parts = rewards(["15", "no answer"], [record, record], [0, 1])
    assert parts == [
        {"correct": 1.0, "length": 0.2, "length/has_digit": 1.0, "longest": 0.0, "scaled": 0.02, "zero": 3.0,
         "digits": 0.2, "digits/has_digit": 1.0},
        {"correct": 0.0, "length": 0.9, "length/has_digit": 0.0, "longest": 1.0, "scaled": 0.09, "zero": 3.0,
         "digits": 0.9, "digits/has_digit": 0.0},
    ]
    # has_digit is logged under both names but summed only through `digits`' declared term (weight 2).
    assert totals == pytest.approx([2.0 + 0.5 * 0.2 + 0.02 + 2.0 * 1.0, 0.5 * 0.9 - 1.0 + 0.09])
    assert resolve_reward_fn(f"{reward_file}:length") is resolve_reward_fn(f"{reward_file}:length")  # loaded once


def test_reward_set_errors(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        textwrap.dedent(
            """
            import math
            calls = []

            def boom(response, record):
                raise KeyError("nums")

            def nan(response, record):
                return math.nan

            def text(response, record):
                return "1.0"

            def shifting(response, record):
                calls.append(1)
                return {"score": 1.0, "a": 1.0} if len(calls) == 1 else {"score": 1.0, "b": 1.0}

            def short(responses, records):
                return [1.0]

            def empty(response, record):
                return {}

            def no_score(response, record):
                return {"correct": 1.0, "len": 3}

            def nothing(response, record):
                return None

            def a_list(response, record):
                return [1.0]

            def scored(response, record):
                return {"score": 1.0, "len": 3}
            """
        )
    )
    record = _record("1")

    def run(entry, responses=("x", "y")):
        return RewardSet.from_config([entry])(list(responses), [record] * len(responses), [4, 5])

    with pytest.raises(RewardError, match=r"boom raised on sample 4 \(prompt 'q', response 'x'\): KeyError: 'nums'"):
        run({"fn": f"{bad}:boom"})
    with pytest.raises(RewardError, match=r"nan returned nan as nan for sample 4; rewards must be finite"):
        run({"fn": f"{bad}:nan"})
    # Issue 22 part 3: any other shape is an error naming the function and the sample.
    for name, shown in (("text", r"'1.0' \(str\)"), ("nothing", r"None \(NoneType\)"), ("a_list", r"\[1.0\] \(list\)")):
        with pytest.raises(RewardError, match=rf"function {name} returned {shown} for sample 4; return a float, or a "
                           "dict with a 'score' key"):
            run({"fn": f"{bad}:{name}"})
    with pytest.raises(RewardError, match=r"shifting returned keys \('b', 'score'\) for sample 5, earlier "
                       r"\('a', 'score'\)"):
        run({"fn": f"{bad}:shifting"})
    with pytest.raises(RewardError, match=r"batched reward function short returned 1 values for 2 responses"):
        run({"fn": f"{bad}:short", "batched": True})
    # issue 18 part 5e: {} summed to a silent 0.0 reward and logged nothing
    with pytest.raises(RewardError) as info:
        run({"fn": f"{bad}:empty"})
    assert str(info.value) == (
        "reward function empty returned a dict without a 'score' key (keys []) for sample 4; return "
        "{'score': reward, ...}: the score is the reward, the other entries are logged (and summed only when "
        "declared in the entry's terms)"
    )
    # issue 22 part 3: a dict without `score` had every entry summed into the reward
    with pytest.raises(RewardError, match=r"no_score returned a dict without a 'score' key "
                       r"\(keys \['correct', 'len'\]\) for sample 4"):
        run({"fn": f"{bad}:no_score"})
    with pytest.raises(RewardError, match=r"scored returned \{'score': 1.0, 'len': 3\} for sample 4, without the "
                       r"entries \['bonus'\] its terms declare"):
        run({"fn": f"{bad}:scored", "terms": {"bonus": 1.0}})
    with pytest.raises(ValueError, match=r"task.rewards\[0\].terms \(\{'score': 2.0\}\) must map dict keys "
                       "other than 'score'"):
        RewardSet.from_config([{"fn": f"{bad}:scored", "terms": {"score": 2.0}}])
    with pytest.raises(ValueError, match=r"task.rewards\[0\].terms \(\{'len': 'x'\}\) must map"):
        RewardSet.from_config([{"fn": f"{bad}:scored", "terms": {"len": "x"}}])
    with pytest.raises(ValueError, match=r"reward names \['a', 'a'\] repeat"):
        RewardSet.from_config([{"fn": "json:loads", "name": "a"}, {"fn": "json:dumps", "name": "a"}])
    with pytest.raises(ValueError, match=r"task.rewards\[0\] .* has unknown keys \['wieght'\]"):
        RewardSet.from_config([{"fn": "json:loads", "wieght": 1.0}])
    with pytest.raises(ValueError, match=r"task.rewards\[0\].weight \('x'\) must be a finite number"):
        RewardSet.from_config([{"fn": "json:loads", "weight": "x"}])
    with pytest.raises(ValueError, match=r"loading .*bad2.py raised SyntaxError"):
        (tmp_path / "bad2.py").write_text("def f(:\n")
        resolve_reward_fn(f"{tmp_path / 'bad2.py'}:f")


@pytest.mark.parametrize(
    "response, reward",
    [("14", 1.0), (" 14 apples", 1.0), ("-3.5", 1.0), ("$12", 1.0), ("The answer is 14", 0.0), ("", 0.0)],
)
def test_leading_number(response, reward):
    assert leading_number(response, _record("#### 14")) == reward


def test_math_answer_without_a_reference_raises():
    """answer_key=null (no answer column): the record's answer is None, and math_answer says so (issue 18 part
    5d; a null in an answer column is refused when the dataset loads, tests/test_datasets.py)."""
    with pytest.raises(RewardError) as info:
        RewardSet.from_config(["topp_rl.tasks.rewards:math_answer"])(["15"], [_record(None)], [3])
    assert str(info.value) == (
        "reward function math_answer raised on sample 3 (prompt 'q', response '15'): ValueError: the record has no "
        "reference answer; set the task's answer_key to the answer column"
    )


def test_unimportable_reward_module_fails_before_the_model_loads(tmp_path, monkeypatch):
    """Issue 22 part 5: `task.reward_fn=myrewards:exact` with myrewards.py beside the user (the working directory
    is not on sys.path) failed with a bare "No module named 'myrewards'" once the model had loaded; now the
    config check says so first, names the working directory and gives the file.py:fn form."""
    from helpers import ROOT, compose_cfg

    from topp_rl.train import build_run

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    # A model path that does not exist: had the model loaded first, its error would come instead.
    cfg = compose_cfg(tmp_path / "run", "task=dataset", f"task.path={ROOT / 'data/gsm8k_sample.jsonl'}",
                      "task.prompt_key=question", "task.reward_fn=myrewards_issue22:exact", "model=hf_path",
                      f"model.path={tmp_path / 'no_model'}")
    with pytest.raises(ValueError) as info:
        build_run(cfg)
    assert str(info.value) == (
        "reward_fn 'myrewards_issue22:exact' cannot be imported: no module named 'myrewards_issue22' on sys.path "
        f"(the script's directory, PYTHONPATH and installed packages; the working directory is {work}); name its "
        "file instead, e.g. myrewards_issue22.py:exact or path/to/myrewards_issue22.py:exact (a relative path is "
        "taken from the working directory), or install the module or put its directory on PYTHONPATH"
    )
    (work / "myrewards_issue22.py").write_text("def exact(response, record):\n    return 1.0\n")
    with pytest.raises(ValueError, match=rf"the working directory is {work}\); {work}/myrewards_issue22.py exists: "
                       r"name it by its file, myrewards_issue22.py:exact$"):
        build_run(cfg)
    # The same check covers task.rewards entries; a module that imports something missing says what is missing.
    (work / "needs_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(work))
    cfg.task.reward_fn = None
    cfg.task.rewards = [{"fn": "needs_dep:f", "weight": 1.0}]
    with pytest.raises(ValueError, match=r"importing needs_dep raised ModuleNotFoundError: No module named "
                       r"'no_such_dependency_xyz'; install what it imports"):
        build_run(cfg)


def test_overlap_computes_a_steps_rewards_while_the_next_step_generates():
    """rollout.overlap=true: step k's reward runs once step k + 1's generation has begun. The reward function
    waits for that generation to start (a rollout that scored first and generated after would time out), and the
    step still trains on its own rewards."""
    import threading

    from topp_rl.engines.embedded import EmbeddedEngine
    from topp_rl.models import build_char_tokenizer, build_tiny_model
    from topp_rl.rollout import RolloutDataModule, RolloutEngine, SamplingParams
    from topp_rl.tasks import CopyDigitTask
    from topp_rl.tasks.rewards import RewardTerm

    inner = EmbeddedEngine(build_tiny_model(seed=0), progress=False, share_weights=False)
    began = {2: threading.Event(), 3: threading.Event()}  # generate calls 2 and 3 (steps 1, 2) have begun

    class Counting(RolloutEngine):
        vocab_size = inner.vocab_size
        calls = 0

        def generate(self, prompts, params, *, seed=None):
            self.calls += 1
            if self.calls in began:
                began[self.calls].set()
            return inner.generate(prompts, params, seed=seed)

        def update_weights(self, named_tensors):
            inner.update_weights(named_tensors)

        def close(self):
            pass

    scored: list[int] = []

    def next_step_began(response, record):
        step = record.index // 2  # 2 prompts per step
        if not began[step + 2].wait(20):
            raise TimeoutError(f"step {step}'s reward ran before step {step + 1} began generating")
        scored.append(step)
        return float(step + 1)

    task = CopyDigitTask()
    task.reward_set = RewardSet([RewardTerm(name="gate", fn=next_step_began)])
    dm = RolloutDataModule(engine=Counting(), task=task, tokenizer=build_char_tokenizer(),
                           params=SamplingParams(top_p=0.9, max_new_tokens=3, n=2), prompts_per_step=2,
                           overlap=True)
    try:
        for step in (0, 1):
            batch = dm.rollout(dm.ticket(step))
            assert [s.reward for s in batch.samples] == [float(step + 1)] * 4
        assert scored == [0] * 4 + [1] * 4
    finally:
        dm.close_engine()
