"""Agent functions for tests/test_endpoint.py, loaded by file path (`task.agent=tests/endpoint_agents.py:fn`) the
way a user's agent file is. Each uses the real openai SDK client the endpoint hands it."""

import asyncio
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
