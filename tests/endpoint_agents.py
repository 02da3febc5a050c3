"""Agent functions for tests/test_endpoint.py, loaded by file path (`task.agent=tests/endpoint_agents.py:fn`) the
way a user's agent file is. Each uses the real openai SDK client the endpoint hands it."""

import asyncio
import re
import time

import openai


def _ids(choice) -> tuple[list[int], list[int]]:
    return list(choice.prompt_token_ids), list(choice.completion_token_ids)


async def chat_two_turns(client, record):
    """Two chat turns; the second re-sends the first reply as history, so it joins the first turn's sample."""
    messages = [{"role": "user", "content": record.text}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "=1"}]
    second = await client.chat.completions.create(model="policy", messages=messages, temperature=1.0, top_p=0.9)
    return {"score": float(len(record.text)), "turns": [_ids(first.choices[0]), _ids(second.choices[0])],
            "finish": [first.choices[0].finish_reason, second.choices[0].finish_reason]}


async def completion_ids(client, record):
    """/v1/completions with token-id prompts: the second prompt is the first's ids + completion + three more."""
    first = await client.completions.create(model="policy", prompt=record.prompt_ids)
    prompt, done = _ids(first.choices[0])
    second = await client.completions.create(model="policy", prompt=prompt + done + [5, 6, 7], max_tokens=1)
    return {"score": 0.5, "turns": [_ids(first.choices[0]), _ids(second.choices[0])],
            "texts": [first.choices[0].text, second.choices[0].text]}


async def rewrites_history(client, record):
    """The second request drops the first turn (history rewritten): a prefix break, a second sample."""
    first = await client.completions.create(model="policy", prompt=record.prompt_ids)
    second = await client.completions.create(model="policy", prompt=record.prompt_ids[:1] + [9, 9])
    return {"score": float(record.index), "turns": [_ids(first.choices[0]), _ids(second.choices[0])]}


async def other_temperature(client, record):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "?a"}],
                                         temperature=0.5)
    return 1.0


async def refusal_message(client, record):
    """The 400 the SDK raises for another top_p, caught: its message is the reward info."""
    try:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "?a"}], top_p=1.0)
    except openai.BadRequestError as e:
        first = await client.completions.create(model="policy", prompt=record.prompt_ids)
        return {"score": 0.0, "status": float(e.status_code), "message": str(e), "ok": first.choices[0].text}
    return {"score": 1.0}


async def too_many_turns(client, record):
    """One request more than rollout.max_turns: the last is refused (400) and the agent raises it."""
    for _ in range(10):
        await client.completions.create(model="policy", prompt=record.prompt_ids)
    return 1.0


async def raises(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    raise KeyError("no such tool")


async def returns_text(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    return "great"


async def no_request(client, record):
    return 1.0


async def hangs(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    await asyncio.sleep(3600)


async def blocks_its_loop(client, record):
    time.sleep(1)  # a sync sleep inside async code: the agents' whole event loop stalls
    return 1.0


async def odd_ones_fail(client, record):
    """Even example indices succeed; odd ones raise after one turn (a mixed step, under max_failed_frac)."""
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    if record.index % 2:
        raise RuntimeError("odd")
    return 1.0


def not_async(client, record):
    return 1.0


async def score_none(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    return {"score": None}


async def score_list(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    return {"score": [1]}


async def score_nan(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    return float("nan")


async def score_huge(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    return 1e300


async def exits(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    raise SystemExit(3)


async def interrupts(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    raise KeyboardInterrupt


async def exits_in_a_task_of_its_own(client, record):
    """SystemExit in a task the agent started: asyncio lets it out of the event loop, which stops every agent."""
    await client.completions.create(model="policy", prompt=record.prompt_ids)

    async def tool():
        raise SystemExit(4)

    await asyncio.get_running_loop().create_task(tool())
    return 1.0


async def odd_ones_ask_a_neighbour(client, record):
    """Odd trajectories send their request to the previous trajectory's URL (with their own client) and swallow the
    refusal; even ones ask their own once. Returns 1.0 either way."""
    url = str(client.base_url)
    mine = int(re.search(r"/traj/(\d+)/", url).group(1))
    if mine % 2:
        neighbour = client.with_options(base_url=url.replace(f"/traj/{mine}/", f"/traj/{mine - 1}/"))
        try:
            await neighbour.completions.create(model="policy", prompt=record.prompt_ids)
        except openai.PermissionDeniedError:
            pass
        return 1.0
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    return 1.0


async def grows_until_refused(client, record):
    """Each prompt is the last prompt + completion + two ids, until the endpoint refuses (the context here)."""
    prompt = list(record.prompt_ids)
    while True:
        try:
            reply = await client.completions.create(model="policy", prompt=prompt)
        except openai.BadRequestError as e:
            return {"score": 1.0, "refusal": str(e)}
        prompt = list(reply.choices[0].prompt_token_ids) + list(reply.choices[0].completion_token_ids) + [5, 6]


async def raises_generator_exit(client, record):
    await client.completions.create(model="policy", prompt=record.prompt_ids)
    raise GeneratorExit


async def asks_many_tokens(client, record):
    """max_tokens=64, more than the run's rollout.max_new_tokens: served at the run's limit, and the response says so."""
    reply = await client.completions.create(model="policy", prompt=record.prompt_ids, max_tokens=64)
    choice = reply.choices[0]
    return {"score": 1.0, "finish": choice.finish_reason, "served": choice.max_tokens,
            "usage": reply.usage.completion_tokens, "ids": len(choice.completion_token_ids)}
